"""How each unit's parameters split into FlatParams, decided from shapes, dtypes and optimizers alone.

A FlatParam is one flat buffer, so it must be uniform in dtype (stored and computed) and in the optimizer that
steps it (stepping one optimizer of a GAN then communicates only its own parameters). Frozen or un-optimized
parameters form their own FlatParam, which is gathered at stage 3 but never reduced and has no master pieces.
Deciding this before any buffer exists lets the comm plan size what it allocates (host-wide parameter buffers,
shared reduction arenas) for every FlatParam at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zero_strategy.core.plan.layout import FlatLayout
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.units import UnitPlan


@dataclass(frozen=True, slots=True)
class FlatSpec:
    """One FlatParam to build: its parameters in flat order and how they are stored and reduced."""

    key: str  # "<unit path>/<position in the unit>": stable across runs (checkpoints use it)
    unit: str  # the unit's module path ("" for the root)
    named_params: tuple[tuple[str, nn.Parameter], ...]
    group_index_of: dict[int, int] | None  # id(param) -> its optimizer param group; None: no optimizer steps it
    optimizer_index: int | None
    compute_dtype: torch.dtype  # what forward sees (the gathered buffer's dtype)
    reduce_dtype: torch.dtype  # gradients are reduced in this dtype
    layout: FlatLayout

    @property
    def label(self) -> str:
        """The unit's name for messages and the divergence watch."""
        return self.unit or "<root>"

    @property
    def trainable(self) -> bool:
        return self.group_index_of is not None

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
    owner: dict[int, tuple[int, int]],
    policy: MixedPrecisionPolicy | None,
    world_size: int,
) -> list[list[FlatSpec]]:
    """Per unit, its FlatSpecs. ``owner``: id(param) → (optimizer index, param group index) for optimized
    parameters; ``world_size``: the ranks each FlatParam is sharded over."""
    return [_unit_specs(unit, owner, policy, world_size) for unit in units]


def _unit_specs(
    unit: UnitPlan, owner: dict[int, tuple[int, int]], policy: MixedPrecisionPolicy | None, world_size: int
) -> list[FlatSpec]:
    keep_fp32 = policy.full_precision_params(unit.module) if policy else set()
    kinds: dict[tuple[torch.dtype, torch.dtype, int | None], list[tuple[str, nn.Parameter]]] = {}
    for name, param in unit.named_params:
        optimized = param.requires_grad and id(param) in owner
        compute = param.dtype if policy is None or id(param) in keep_fp32 else policy.compute_dtype_for(param)
        kinds.setdefault((param.dtype, compute, owner[id(param)][0] if optimized else None), []).append((name, param))
    specs: list[FlatSpec] = []
    for position, ((_, compute, optimizer_index), named) in enumerate(kinds.items()):
        group_of = None
        if optimizer_index is not None:
            named.sort(key=lambda item: owner[id(item[1])][1])  # one contiguous range per param group
            group_of = {id(p): owner[id(p)][1] for _, p in named}
        layout = FlatLayout.build([(n, tuple(p.shape)) for n, p in named], world_size)
        reduce_dtype = policy.reduce_dtype if policy is not None else compute
        specs.append(FlatSpec(f"{unit.name}/{position}", unit.name, tuple(named), group_of, optimizer_index,
                              compute, reduce_dtype, layout))
    return specs
