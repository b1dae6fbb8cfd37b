"""What the module holds when the engine lets it go, and how a later engine takes the weights back.

[Note: releasing a model built sharded]
Releasing the engine normally gathers every unit and gives each parameter a standalone full tensor, so after
``fit`` the module works without us. For a model built sharded at stage 3 (meta construction or pretrained
loading: no rank ever held it whole) that gather is the one moment the whole model would be resident on every
rank at once — for a model bigger than one rank's memory, an out-of-memory kill right after the last step
(measured: a 1.09 B-parameter GPT under zero3_offload_nvme reached 8.5 GiB of anonymous memory per rank in the
gather, 3.5 x its training peak). So the default ("auto", ``ZeroConfig.full_params_after_fit=None``) depends on
how the model was built:

- built eagerly on every rank, or at stages 1/2 (where every rank holds the full parameters all along): gathered,
  as before; the memory demonstrably fits.
- built sharded at stage 3: the parameters stay sharded. The module's parameters move to the meta device (shapes,
  dtypes and identities kept; no storage) and the released engine's slices remain the only copy of the weights,
  as DeepSpeed's partitioned parameters and FSDP2's DTensors do after training. ``trainer.save_checkpoint`` writes
  them (sharded, optimizer state included) and a later ``validate``/``test``/``predict``/``fit`` on the same
  Trainer builds its engine from them (:class:`ReleasedShards`), each rank reading only its own slices.

``full_params_after_fit=True`` forces the gather (when the model is known to fit), ``False`` forbids it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from zero_strategy.core.flat.access import forget_owner
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.param_values import meta_placeholder, point_at
from zero_strategy.core.flat.whole import gather_whole, own_parts, param_views
from zero_strategy.core.plan.tensor_parallel import local_part


def gather_into_module(flat: FlatParam) -> None:
    """Give every parameter its own full tensor again, gathered from the slices in their own precision (the fp32
    masters under mixed precision, not the compute copies): the module works without us and holds the weights the
    optimizer produced. Collective over the shard group (through the FlatParam's own Comm)."""
    flat.settle()
    whole = gather_whole(flat, flat.shard, f"release of {flat.label}")
    flat.own_shard()  # it may be a view of the gathered buffer (private or host-wide) or of a file, dropped below
    with torch.no_grad():
        for (_, values), param in zip(param_views(flat, whole), flat.params, strict=True):
            point_at(param, values.clone())
            forget_owner(param)
    flat.storage.detach_full()


def leave_sharded(flat: FlatParam) -> None:
    """Leave the module's parameters on the meta device (shapes, dtypes and identities kept, no storage) and keep
    this rank's slice as the only copy of the weights (see [Note: releasing a model built sharded])."""
    flat.settle()
    if flat.storage.shard_aliases_full:
        flat.own_shard()
    for param in flat.params:
        if not param.is_meta:
            torch.utils.swap_tensors(param, meta_placeholder(param))
    flat.storage.detach_full()


def adopt_module_values(flats: Iterable[FlatParam]) -> None:
    """A *released* engine's slices take this rank's part of the module's current full parameters (a parameter left
    sharded, on the meta device, is skipped: the slice is its only copy): a save after release writes what the
    module holds, even if the user changed it since."""
    with torch.no_grad():
        for flat in flats:
            for name, param in zip(flat.names, flat.params, strict=True):
                if param.is_meta:
                    continue
                # a tensor-parallel parameter: its own block (the flat layout is of local blocks)
                for piece, values in own_parts(flat, name, local_part(param.detach())):
                    flat.shard[piece.shard_start : piece.shard_start + piece.numel].copy_(values)


class ReleasedShards:
    """Reads a released engine's slices by parameter name and element range: the ``WeightsReader`` a later engine
    over the same module loads from (see [Note: releasing a model built sharded]). Only this rank's own ranges are
    there; a later engine with the same module, world and unit plan asks for exactly those."""

    # its slices are of each parameter's local block (a tensor-parallel parameter's TP block), not of the global
    # tensor a file holds (read by core/init/materialize.py's load_pretrained)
    local_blocks = True

    def __init__(self, flats: Iterable[FlatParam]) -> None:
        self._pieces: dict[tuple[str, int, int], tuple[FlatParam, int]] = {}
        self._name_of: dict[int, str] = {}  # id(parameter) -> its name in the released engine
        for flat in flats:
            self._name_of.update((id(param), name) for name, param in zip(flat.names, flat.params, strict=True))
            for overlap in flat.layout.overlaps(flat.rank):
                self._pieces[(overlap.name, overlap.param_start, overlap.numel)] = (flat, overlap.shard_start)

    def plan_for(self, module: nn.Module) -> dict[str, tuple[ReleasedShards, str]]:
        """{name in ``module``: (self, name in the released engine)} for every meta parameter of ``module`` the
        released engine held (tied names included: they are one parameter object)."""
        plan: dict[str, tuple[ReleasedShards, str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if param.is_meta and id(param) in self._name_of:
                plan[name] = (self, self._name_of[id(param)])
        return plan

    def read(
        self, name: str, start: int = 0, count: int | None = None, dtype: torch.dtype | None = torch.float32
    ) -> Tensor:
        found = self._pieces.get((name, start, -1 if count is None else count))
        if found is None:
            raise RuntimeError(
                f"{name!r}[{start}:{start + (count or 0)}] is not a slice this rank kept when the previous engine "
                "was released: the module, the world size or the unit plan changed since. Save a checkpoint "
                "(trainer.save_checkpoint) and load it, or set full_params_after_fit=True to keep full parameters."
            )
        flat, shard_start = found
        values = flat.shard[shard_start : shard_start + (count or 0)]
        return values.to(dtype) if dtype is not None else values
