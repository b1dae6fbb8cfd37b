"""Loading a sharded checkpoint into a sharded engine: any world size, any stage, any unit layout.

``load_weights``, ``load_optimizer_state`` and ``restore_rank_rng`` read through :class:`ReadableCheckpoint`, so a
``torch.distributed.checkpoint`` directory (checkpoint/dcp/reader.py) loads through the same code as our own format.

Every check runs before the first tensor is written, so a checkpoint that does not fit leaves the model and the
optimizers exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.base.loadable import LoadTarget
from zero_strategy.checkpoint.base.rng import restore_rng
from zero_strategy.checkpoint.base.source import ReadableCheckpoint
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.shard_content import scalar_value
from zero_strategy.core.engine.optimizer import qualified_name
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.plan.tensor_parallel import local_shape


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What will be loaded, decided by :func:`check_compatible`."""

    with_optimizer: bool
    missing: list[str]  # parameters of the model the checkpoint lacks (non-strict loading only)


def check_compatible(engine: LoadTarget, ckpt: ShardedCheckpoint, strict: bool, with_optimizer: bool) -> LoadPlan:
    """Raise :class:`CheckpointError` if the checkpoint does not describe this model (and its optimizers)."""
    where = ckpt.path
    # a tensor-parallel parameter's block: what the checkpoint of this rank's TP coordinate holds
    model = {n: local_shape(p) for flat in engine.flat_params for n, p in zip(flat.names, flat.params, strict=True)}
    stored = {name: tuple(param.shape) for name, (_, param) in ckpt.params.items()}
    wrong_shape = [
        f"{n}: checkpoint {stored[n]} vs model {shape}" for n, shape in model.items() if stored.get(n, shape) != shape
    ]
    missing = sorted(set(model) - set(stored))
    unexpected = sorted(set(stored) - set(model))
    if wrong_shape or (strict and (missing or unexpected)):
        raise CheckpointError(
            f"{where} is a checkpoint of another model: "
            + "; ".join(
                part
                for part in (
                    f"shape mismatch {wrong_shape[:5]}" if wrong_shape else "",
                    f"missing parameters {missing[:5]}" if missing and strict else "",
                    f"unexpected parameters {unexpected[:5]}" if unexpected and strict else "",
                )
                if part
            )
        )
    if with_optimizer:
        if not ckpt.manifest.has_optimizer_state:
            why = ckpt.manifest.extra.get("optimizer_state_absent", "saved with save_weights_only=True")
            raise CheckpointError(
                f"{where} holds no optimizer state ({why}), so a fit cannot resume from it. To start a new fit "
                "from its weights: zero_strategy.consolidate(checkpoint, 'model.pt'), load that state_dict into "
                "the module, and fit without ckpt_path."
            )
        saved = ckpt.manifest.optimizers
        current = [{"class": qualified_name(o), "param_groups": len(o.param_groups)} for o in engine.optimizers]
        if saved != current:
            raise CheckpointError(f"{where}: optimizers differ: checkpoint {saved}, this run {current}")
        _check_groups(engine, ckpt)
    return LoadPlan(with_optimizer=with_optimizer, missing=missing)


def _check_groups(engine: LoadTarget, ckpt: ShardedCheckpoint) -> None:
    """Every parameter is in the same param group of the same optimizers as when it was saved."""
    for flat in engine.flat_params:
        for name, groups in zip(flat.names, flat.param_groups, strict=True):
            if name not in ckpt.params:
                continue
            here = dict(zip(flat.optimizers, groups, strict=True))
            stored_flat, stored = ckpt.params[name]
            saved = stored_flat.group_of(stored)
            if saved != here:
                raise CheckpointError(
                    f"{ckpt.path}: parameter {name} is in {_describe_groups(saved)} in the checkpoint but in "
                    f"{_describe_groups(here)} in this run"
                )


def _describe_groups(groups: dict[int, int]) -> str:
    if not groups:
        return "no optimizer"
    return ", ".join(f"param group {group} of optimizer {optimizer}" for optimizer, group in groups.items())


def load_weights(engine: LoadTarget, ckpt: ReadableCheckpoint) -> None:
    """Fill every rank's master shards from the checkpoint, whatever layout wrote it."""
    rank = engine.place.rank
    engine.before_load()  # peers done reading the slices written here (stage 3 on one host)
    with torch.no_grad():
        for flat in engine.flat_params:
            for piece in flat.layout.overlaps(rank):
                if piece.name not in ckpt.params:
                    continue
                values = ckpt.read_param(piece.name, "flat", piece.param_start, piece.numel)
                flat.shard[piece.shard_start : piece.shard_start + piece.numel].copy_(values)
    engine.after_load()


def load_optimizer_state(engine: LoadTarget, ckpt: ReadableCheckpoint, param_groups: list[list[dict]]) -> None:
    """Rebuild each master piece's optimizer state from the elements it now covers, and the groups' hyper-
    parameters (learning rates moved by schedulers)."""
    for optimizer, groups in zip(engine.optimizers, param_groups, strict=True):
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
    for flat in engine.flat_params:
        for opt_index in flat.optimizers:  # several optimizers stepping one FlatParam: each its own state
            optimizer = engine.optimizers[opt_index]
            for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
                state = _piece_state(engine, ckpt, flat, (offset, piece), opt_index)
                _place_step_counters(optimizer, piece, state)
                if state:
                    optimizer.state[piece] = _to_offload_files(engine, optimizer, piece, state)
    if engine.placement is not None and engine.placement.store is not None:
        engine.placement.store.release_pages()


def _place_step_counters(optimizer: torch.optim.Optimizer, piece: nn.Parameter, state: dict[str, object]) -> None:
    """A tensor ``step`` counter stays on the CPU unless the piece's param group is ``capturable`` or ``fused``, as
    torch's own ``Optimizer.load_state_dict`` places it: a non-capturable Adam reads it on the host every step, so a
    counter on the GPU would cost a device-to-host synchronisation per step. (The fused steps this package turns on
    move it to the device themselves, just before a fused step: see _step_state_to_device in
    core/engine/optimizer.py.)"""
    step = state.get("step")
    if not isinstance(step, torch.Tensor):
        return
    group = next((g for g in optimizer.param_groups if any(p is piece for p in g["params"])), {})
    on_device = bool(group.get("capturable", False) or group.get("fused", False))
    state["step"] = step.to(dtype=torch.float32, device=piece.device) if on_device else step.to("cpu")


def _to_offload_files(
    engine: LoadTarget, optimizer: torch.optim.Optimizer, piece: nn.Parameter, state: dict[str, object]
) -> dict[str, object]:
    """With nvme offload, loaded element-wise state goes into files like the state the optimizer creates (named as
    chunked_step names them: one file per optimizer, piece and state)."""
    store = engine.placement.store if engine.placement is not None else None
    if store is None:
        return state
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            name = f"state-{id(optimizer)}-{id(piece)}-{key}"
            backed = store.tensor(name, piece.numel(), value.dtype).view_as(piece)
            backed.copy_(value)
            state[key] = backed
    return state


def _piece_state(
    engine: LoadTarget, ckpt: ReadableCheckpoint, flat: FlatParam, piece: tuple[int, nn.Parameter], optimizer: int
) -> dict[str, object]:
    """Optimizer ``optimizer``'s state of one master piece (``(its offset in the shard, the piece)``), gathered
    parameter by parameter from the checkpoint."""
    offset, master = piece
    end = offset + master.numel()
    overlapping = [o for o in flat.layout.overlaps(engine.place.rank) if offset <= o.shard_start < end]
    if not overlapping or overlapping[0].name not in ckpt.params:
        return {}
    first_flat, first_param = ckpt.params[overlapping[0].name]
    names = ckpt.state_names(first_flat, optimizer)
    state: dict[str, object] = {}
    for name in names:
        values = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
        for overlap in overlapping:
            chunk = ckpt.read_param(overlap.name, f"optim:{name}", overlap.param_start, overlap.numel, optimizer)
            values = values.to(chunk.dtype)
            values[overlap.shard_start - offset : overlap.shard_start - offset + overlap.numel].copy_(chunk)
        state[name] = values.view_as(master)
    position = first_param.offset + overlapping[0].param_start
    for name, record in ckpt.scalar_state_at(first_flat, position, optimizer).items():
        state[name] = scalar_value(record, torch.device("cpu") if name == "step" else master.device)
    return state


def restore_rank_rng(engine: LoadTarget, ckpt: ReadableCheckpoint) -> bool:
    """Restore the generator states that the rank at this rank's position in the saving run saved (False, and this
    rank's own left as they are, if that run had no such rank); see [Note: every rank's RNG is saved] in
    checkpoint/base/rng.py."""
    saved = ckpt.rng_state(engine.comms.everyone.rank)  # its position among every rank of the run
    if saved is None:
        return False
    restore_rng(*saved)
    return True
