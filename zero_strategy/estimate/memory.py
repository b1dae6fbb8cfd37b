"""``zero-estimate``'s entry points: will a model fit, and with which ZeRO stage / offload? Per-rank bytes, before a
run: :func:`estimate_memory` (one configuration), :func:`compare` (all of :data:`CONFIGURATIONS`),
:func:`smallest_fitting`.

The rules behind each category are in :mod:`.arithmetic`; the model's description in :mod:`.shapes`; what is
returned in :mod:`.results`. Those names are re-exported here, where they were first defined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from zero_strategy.config import OffloadDevice, ZeroConfig
from zero_strategy.core.plan.precision_names import COMPUTE_DTYPES, normalize_precision
from zero_strategy.estimate.activations import measure_activation_bytes
from zero_strategy.estimate.arithmetic import (
    RunSetup,
    communication_bytes,
    gradients_bytes,
    master_bytes,
    notes,
    optimizer_state_bytes,
    parameters_bytes,
)
from zero_strategy.estimate.results import (
    CONFIGURATIONS,
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    Placed,
    state_bytes_per_element,
)
from zero_strategy.estimate.shapes import (
    ENGINE_DEFAULTS,
    FlatSpec,
    ModelShape,
    count_shape,
    describe_model,
    guess_unit_numel,
)
from zero_strategy.estimate.tensor_parallel import TensorParallel

__all__ = [
    "CONFIGURATIONS",
    "OPTIMIZER_STATE_BYTES",
    "EstimateOptions",
    "FlatSpec",
    "MemoryEstimate",
    "ModelShape",
    "Placed",
    "compare",
    "describe_model",
    "estimate_memory",
    "first_fitting",
    "guess_unit_numel",
    "measure_activation_bytes",
    "smallest_fitting",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimateOptions:
    """What :func:`estimate_memory` and :func:`compare` accept besides the model, world size, stage and offload."""

    precision: str = "32-true"
    optimizer: str = "adamw"  # a key of OPTIMIZER_STATE_BYTES
    largest_unit_numel: int | None = None  # overrides the largest non-root unit (guessed without a model)
    root_unit_numel: int | None = None  # overrides the root unit (assumed as large as a block without a model)
    sample_batch: Any = None  # one rank's micro-batch: activations are measured with the model
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None  # loss of sample_batch (default: sum of outputs)
    activation_bytes: int | None = None  # activations per rank, when known (skips the measurement)
    unit_modules: tuple[str, ...] = ()  # as ZeroConfig.unit_modules
    min_unit_numel: int = ENGINE_DEFAULTS.min_unit_numel
    prefetch: bool = ENGINE_DEFAULTS.prefetch
    reduce_dtype: torch.dtype = torch.float32  # mixed precision only (ZeroPrecision's reduce_dtype)
    nvme_chunk_numel: int = ENGINE_DEFAULTS.nvme_chunk_numel
    compute_device: str = "cuda"  # "cpu": the offloaded slices already are where the compute is (no device copy)
    # "point_to_point": CPU ranks gather and reduce through the network, as when asked for or when /dev/shm lacks
    # room under "auto" (see ZeroConfig.collectives); "auto": through shared memory where a run would use it
    collectives: str = "auto"
    tensor_parallel: int = 1  # K: each rank holds its TP shards; ZeRO shards them over world_size / K ranks
    tp_fraction: float | None = None  # see [Note: which parameters the estimate takes as tensor-parallel]

    def __post_init__(self) -> None:
        if self.collectives not in ("auto", "point_to_point"):
            raise ValueError(f"collectives={self.collectives!r}: use 'auto' or 'point_to_point'")
        TensorParallel(size=self.tensor_parallel, fraction=self.tp_fraction)  # validates both

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(size=self.tensor_parallel, fraction=self.tp_fraction)


def _prepare(model_or_param_count: nn.Module | float, o: EstimateOptions) -> tuple[ModelShape, int | None]:
    """The model's shape and activations: what every configuration of one comparison shares."""
    dtype = COMPUTE_DTYPES[normalize_precision(o.precision)]
    state_bytes_per_element(o.optimizer)  # an unknown name fails before any measurement
    tp = o.tp  # one TP rank's part of every count (see [Note: which parameters the estimate takes as tensor-parallel])
    largest, root = (None if n is None else tp.local_count(n) for n in (o.largest_unit_numel, o.root_unit_numel))
    if not isinstance(model_or_param_count, nn.Module):
        if o.sample_batch is not None:
            raise ValueError("sample_batch needs a model to run: pass the nn.Module, not a parameter count")
        psi = round(float(model_or_param_count))
        if psi < 1:
            raise ValueError(f"the parameter count must be positive, got {model_or_param_count!r}")
        if tp.size > 1 and largest is None:  # a block of the whole model, split as the plan splits it
            largest = tp.local_count(guess_unit_numel(psi))
        shape = count_shape(tp.local_count(psi), dtype, largest, root)
        guessed = o.largest_unit_numel is None or o.root_unit_numel is None
        return replace(shape, guessed_units=guessed), o.activation_bytes
    model = model_or_param_count
    shape = describe_model(model, o.precision, o.unit_modules, o.min_unit_numel, tp.local_numel(model))
    if largest is not None:
        shape = replace(shape, largest=(FlatSpec(largest, dtype, torch.float32, True),))
    if root is not None:
        shape = replace(shape, root=(FlatSpec(root, dtype, torch.float32, True),))
    activations = o.activation_bytes
    if activations is None and o.sample_batch is not None:
        activations = measure_activation_bytes(model, o.sample_batch, o.precision, o.loss_fn)
    return shape, activations


def _estimate(
    prepared: tuple[ModelShape, int | None], o: EstimateOptions, world_size: int, stage: int, offload: tuple[str, str]
) -> MemoryEstimate:
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    data_parallel = o.tp.data_parallel_size(world_size)  # the ranks ZeRO shards each TP rank's part over
    # ZeroConfig refuses what a run would refuse (offload_param below stage 3, nvme params without nvme masters)
    config = ZeroConfig(stage=stage, offload_optimizer=OffloadDevice(offload[0]),
                        offload_param=OffloadDevice(offload[1]), nvme_path="<estimate>")  # fmt: skip
    shape, activations = prepared
    precision = normalize_precision(o.precision)
    mixed = COMPUTE_DTYPES[precision] != torch.float32
    setup = RunSetup(
        world_size=data_parallel, stage=config.zero_stage, reduce_dtype=o.reduce_dtype if mixed else None,
        offload_optimizer=config.offload_optimizer, offload_param=config.offload_param,
        state_bytes=state_bytes_per_element(o.optimizer), prefetch=o.prefetch, nvme_chunk_numel=o.nvme_chunk_numel,
        accelerator=o.compute_device != "cpu", network=o.collectives == "point_to_point",
    )  # fmt: skip
    return MemoryEstimate(
        stage=stage, precision=precision, world_size=world_size, offload_optimizer=config.offload_optimizer.value,
        offload_param=config.offload_param.value, optimizer=o.optimizer.lower(), num_params=shape.num_params,
        parameters=parameters_bytes(shape, setup), master=master_bytes(shape, setup),
        gradients=gradients_bytes(shape, setup), optimizer_state=optimizer_state_bytes(shape, setup),
        communication=communication_bytes(shape, setup), activations=Placed(device=activations or 0),
        notes=notes(shape, setup, activations is not None) + ((o.tp.note,) if o.tp.note else ()),
        tensor_parallel=o.tp.size,
    )  # fmt: skip


def estimate_memory(
    model_or_param_count: nn.Module | float, *, world_size: int, stage: int, precision: str = "32-true",
    offload_optimizer: str = "none", offload_param: str = "none", optimizer: str = "adamw",
    largest_unit_numel: int | None = None, sample_batch: Any = None, **options: Any,
) -> MemoryEstimate:  # fmt: skip
    """Per-rank bytes of one ZeRO configuration: on the device, in host memory and in offload files.

    ``model_or_param_count``: an ``nn.Module`` — its units and FlatParams are planned exactly as ``ZeroEngine``
    would (a ``meta``-device model works) — or a parameter count, for which unit sizes are guessed
    (:func:`guess_unit_numel`; override with ``largest_unit_numel`` / ``root_unit_numel``).
    ``sample_batch`` (with a model): one rank's micro-batch; activations are then *measured* by one
    forward/backward of the model in this process (:func:`measure_activation_bytes`). Other keywords: the fields
    of :class:`EstimateOptions`. Not included: the CUDA context, allocator fragmentation, buffers (BatchNorm
    statistics) and the transient fp32 copy of each unit while the engine is built.
    """
    o = EstimateOptions(precision=precision, optimizer=optimizer, largest_unit_numel=largest_unit_numel,
                        sample_batch=sample_batch, **options)  # fmt: skip
    return _estimate(_prepare(model_or_param_count, o), o, world_size, stage, (offload_optimizer, offload_param))


def compare(model_or_param_count: nn.Module | float, *, world_size: int, **options: Any) -> list[MemoryEstimate]:
    """Every stage with and without offload (:data:`CONFIGURATIONS`), cheapest first; activations measured once.
    Keywords: those of :func:`estimate_memory` except the stage and offload."""
    o = EstimateOptions(**options)
    prepared = _prepare(model_or_param_count, o)
    return [_estimate(prepared, o, world_size, stage, (opt, par)) for stage, opt, par in CONFIGURATIONS]


def first_fitting(
    estimates: Sequence[MemoryEstimate], device_memory_bytes: float, host_memory_bytes: float | None = None
) -> MemoryEstimate | None:
    """The first of ``estimates`` (ordered cheapest first) that fits, or None."""
    return next((e for e in estimates if e.fits(device_memory_bytes, host_memory_bytes)), None)


def smallest_fitting(
    model_or_param_count: nn.Module | float, device_memory_bytes: float, *, world_size: int,
    host_memory_bytes: float | None = None, **options: Any,
) -> MemoryEstimate | None:  # fmt: skip
    """The cheapest configuration whose per-rank device bytes fit — no offload before offload, cpu before nvme,
    lower stage before higher; ``host_memory_bytes``: host budget per rank. None when nothing fits."""
    estimates = compare(model_or_param_count, world_size=world_size, **options)
    return first_fitting(estimates, device_memory_bytes, host_memory_bytes)
