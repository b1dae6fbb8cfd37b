"""How each unit's parameters split into FlatParams, decided from shapes, dtypes and optimizers alone.

A FlatParam is one flat buffer, so it must be uniform in dtype (stored and computed) and in the set of optimizers
that step it (stepping one optimizer of a GAN then communicates only its own parameters; a layer two optimizers
share is a FlatParam of its own, stepped by both: see [Note: optimizers sharing parameters] in engine/window.py).
Frozen or un-optimized parameters form their own FlatParam, which is gathered at stage 3 but never reduced and has
no master pieces. Deciding this before any buffer exists lets EngineComms size what it allocates (host-wide
parameter buffers, shared reduction arenas) for every FlatParam at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zero_strategy.core.plan.layout import FlatLayout
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.tensor_parallel import local_shape, sharded_over_tensor_parallel
from zero_strategy.core.plan.units import UnitPlan


@dataclass(frozen=True, slots=True)
class FlatSpec:
    """One FlatParam to build: its parameters in flat order and how they are stored and reduced."""

    key: str  # "<unit path>/<position in the unit>": stable across runs (checkpoints use it)
    unit: str  # the unit's module path ("" for the root)
    named_params: tuple[tuple[str, nn.Parameter], ...]
    optimizers: tuple[int, ...]  # the optimizers that step every parameter of it, ascending; (): none steps it
    groups_of: dict[int, tuple[int, ...]]  # id(param) -> its param group in each of `optimizers` ({} when none)
    compute_dtype: torch.dtype  # what forward sees (the gathered buffer's dtype)
    reduce_dtype: torch.dtype  # gradients are reduced in this dtype
    # of the parameters' local blocks: see [Note: ZeRO over the data-parallel dimension of a 2-D mesh]
    layout: FlatLayout
    tensor_sharded: bool = False  # its parameters hold different blocks on each tensor-parallel rank

    @property
    def label(self) -> str:
        """The unit's name for messages and the divergence watch."""
        return self.unit or "<root>"

    @property
    def trainable(self) -> bool:
        return bool(self.optimizers)

    def group_in(self, param: nn.Parameter, optimizer: int) -> int:
        """``param``'s param group in optimizer ``optimizer`` (one of :attr:`optimizers`)."""
        return self.groups_of[id(param)][self.optimizers.index(optimizer)]

    @property
    def stored_dtype(self) -> torch.dtype:
        """The parameters' own dtype: the master slice keeps it (fp32 under mixed precision)."""
        return self.named_params[0][1].dtype

    @property
    def gather_bytes(self) -> int:
        """Bytes of the whole gathered buffer."""
        return self.layout.padded_numel * self.compute_dtype.itemsize

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one flattened gradient (the input of each reduction)."""
        return self.layout.padded_numel * self.reduce_dtype.itemsize


def plan_flat_params(
    units: list[UnitPlan],
    owners: dict[int, tuple[tuple[int, int], ...]],
    policy: MixedPrecisionPolicy | None,
    world_size: int,
) -> list[list[FlatSpec]]:
    """Per unit, its FlatSpecs. ``owners``: id(param) → its (optimizer index, param group index) in every optimizer
    that holds it, ascending by optimizer; ``world_size``: the ranks each FlatParam is sharded over."""
    return [_unit_specs(unit, owners, policy, world_size) for unit in units]


def _unit_specs(
    unit: UnitPlan, owners: dict[int, tuple[tuple[int, int], ...]], policy: MixedPrecisionPolicy | None,
    world_size: int,
) -> list[FlatSpec]:
    keep_fp32 = policy.full_precision_params(unit.module) if policy else set()
    kinds: dict[tuple[torch.dtype, torch.dtype, tuple[int, ...], bool], list[tuple[str, nn.Parameter]]] = {}
    for name, param in unit.named_params:
        held = owners.get(id(param), ()) if param.requires_grad else ()
        compute = param.dtype if policy is None or id(param) in keep_fp32 else policy.compute_dtype_for(param)
        kind = (param.dtype, compute, tuple(o for o, _ in held), sharded_over_tensor_parallel(param))
        kinds.setdefault(kind, []).append((name, param))
    specs: list[FlatSpec] = []
    for position, ((_, compute, optimizers, tensor_sharded), named) in enumerate(kinds.items()):
        groups_of = {id(p): tuple(g for _, g in owners[id(p)]) for _, p in named} if optimizers else {}
        # Sorted by the tuple of groups: each combination of groups is one contiguous range (the first optimizer's
        # groups are contiguous runs), so master pieces are cut only where some optimizer's group changes.
        named.sort(key=lambda item: groups_of.get(id(item[1]), ()))
        layout = FlatLayout.build([(n, local_shape(p)) for n, p in named], world_size)
        reduce_dtype = policy.reduce_dtype if policy is not None else compute
        specs.append(FlatSpec(f"{unit.name}/{position}", unit.name, tuple(named), optimizers, groups_of,
                              compute, reduce_dtype, layout, tensor_sharded))
    return specs
