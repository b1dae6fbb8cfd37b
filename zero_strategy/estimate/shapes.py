"""What the estimator needs to know about a model: the FlatParams and units ``ZeroEngine`` would build for it
(:func:`describe_model`, exact for an ``nn.Module``, ``meta`` device included), or a guess from a parameter count."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.precision_names import COMPUTE_DTYPES, normalize_precision
from zero_strategy.core.plan.units import choose_unit_modules, plan_units

ENGINE_DEFAULTS = ZeroConfig()  # the engine's defaults (unit threshold, prefetch, nvme chunk), read from one place


@dataclass(frozen=True, slots=True)
class FlatSpec:
    """One FlatParam the engine would build: a unit's parameters of one kind (dtype, compute dtype, trained)."""

    numel: int
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    trainable: bool

    def shard(self, world_size: int) -> int:
        return -(-self.numel // world_size)

    def padded(self, world_size: int) -> int:
        return self.shard(world_size) * world_size


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs to know about a model: every FlatParam, and the units whole at stage 3."""

    flats: tuple[FlatSpec, ...]
    root: tuple[FlatSpec, ...]  # the root unit: whole through a stage-3 forward/backward
    largest: tuple[FlatSpec, ...]  # the largest other unit (empty when the root is the only unit)
    num_params: int
    guessed_units: bool = False


def _unit_flats(named: list[tuple[str, nn.Parameter]], keep_fp32: set[int], dtype: torch.dtype,
                numel: Callable[[nn.Parameter], int]) -> list[FlatSpec]:  # fmt: skip
    """Group a unit's parameters as ``ZeroUnit`` does: one FlatParam per (dtype, compute dtype, trained)."""
    kinds: dict[tuple[torch.dtype, torch.dtype, bool], int] = {}
    for _, param in named:
        floating = param.is_floating_point() and id(param) not in keep_fp32
        compute = dtype if floating and dtype != torch.float32 else param.dtype
        key = (param.dtype, compute, param.requires_grad)
        kinds[key] = kinds.get(key, 0) + numel(param)
    return [FlatSpec(numel, compute, stored, trained) for (stored, compute, trained), numel in kinds.items()]


def describe_model(
    model: nn.Module, precision: str = "32-true", unit_modules: Sequence[str] = (), min_unit_numel: int | None = None,
    local_numel: Callable[[nn.Parameter], int] | None = None,
) -> ModelShape:  # fmt: skip
    """The FlatParams and units ``ZeroEngine`` would build for ``model`` (works on a ``meta``-device model).
    ``local_numel``: the elements a rank holds of each parameter (tensor parallelism: its shard); default all."""
    dtype = COMPUTE_DTYPES[normalize_precision(precision)]
    threshold = ENGINE_DEFAULTS.min_unit_numel if min_unit_numel is None else min_unit_numel
    plans = plan_units(model, choose_unit_modules(model, list(unit_modules), threshold))
    keep_fp32 = MixedPrecisionPolicy(dtype).full_precision_params(model) if dtype != torch.float32 else set()
    numel = local_numel or (lambda param: param.numel())
    units = {plan.name: tuple(_unit_flats(plan.named_params, keep_fp32, dtype, numel)) for plan in plans}
    others = [flats for name, flats in units.items() if name]
    largest = max(others, key=lambda flats: sum(f.numel for f in flats), default=())
    num_params = sum(f.numel for flats in units.values() for f in flats)
    return ModelShape(tuple(f for flats in units.values() for f in flats), units.get("", ()), largest, num_params)


def guess_unit_numel(num_params: int) -> int:
    """A transformer block's size for a model known only by its parameter count: Ψ ≈ 12·L·d² with d ≈ 128·L (the
    aspect ratio of GPT-3, Llama-7B/65B), one block = Ψ/L. Llama-65B: 0.94e9 guessed, 0.81e9 real."""
    layers = max(1.0, (num_params / (12 * 128**2)) ** (1 / 3))
    return min(num_params, math.ceil(num_params / layers))


def count_shape(num_params: int, dtype: torch.dtype, largest: int | None, root: int | None) -> ModelShape:
    unit = min(num_params, largest if largest is not None else guess_unit_numel(num_params))
    # without a model the root (embeddings, head) is assumed as large as a block: conservative for most LLMs
    root_numel = min(num_params - unit, root if root is not None else unit)
    flat = FlatSpec(num_params, dtype, torch.float32, True)
    root_specs = (FlatSpec(root_numel, dtype, torch.float32, True),) if root_numel > 0 else ()
    guessed = largest is None or root is None
    return ModelShape((flat,), root_specs, (FlatSpec(unit, dtype, torch.float32, True),), num_params, guessed)
