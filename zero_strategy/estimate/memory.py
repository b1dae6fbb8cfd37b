"""``zero-estimate``'s arithmetic: will a model fit, and with which ZeRO stage / offload? Per-rank bytes, before a run.

The arithmetic mirrors what the core allocates (``core/flat/storage.py``, ``core/runtime/hooks.py``,
``core/flat/placement.py``), not the ZeRO paper; where the two differ the code wins. Ψ = parameters, N = ranks,
c = compute-dtype bytes:

- parameters (compute copies): stages 1/2 keep the whole padded flat buffer, cΨ. Stage 3 keeps nothing at rest;
  during forward/backward the root unit (embeddings, head: whatever is in no ``ModuleList`` child) stays whole,
  plus the unit computing and, with prefetch, the next one. The all-gather writes straight into those buffers, so
  there is no separate gather buffer (prefetch adds one unit here, not to "communication"). Stage 3 on CPU ranks
  (assumed on one host) without offload instead keeps each unit's buffer once per host in shared memory and
  reads it in place (see [Note: shared-memory gathers]): each rank is charged its own slice, cΨ/N, at rest and
  at the peak alike (the peers' pages it maps while a unit is in use are theirs).
- master weights: the fp32 slice, 4Ψ/N; a view of the parameters (0 bytes) in fp32 without offload at stages 1/2
  and in stage 3's shared buffers.
- gradients: stage 1 keeps full-size gradients until the step (fp32 ``.grad`` in fp32; under mixed precision an
  fp32 stash, so 4Ψ, where the paper counts 2Ψ); stages 2/3 keep only the fp32 slice 4Ψ/N (paper: 2Ψ/N).
- optimizer state: bytes per fp32 master element from :data:`OPTIMIZER_STATE_BYTES`, on this rank's slice.
- communication: transient buffers of the largest unit — the flat reduce buffer, the reduce-scatter output, the
  gather source copy and, at stages 2/3, the ``.grad`` tensors waiting for the reduction (the root's wait longest).
  CPU ranks reduce through ``ARENAS`` (2) shared-memory arenas of the largest flattened gradient instead of the flat
  buffer (see [Note: shared-memory reductions]); they are held for the whole run.
- offload "cpu": masters, gradient slices and optimizer state move to host memory, but on a GPU a compute-dtype
  copy of the slice (cΨ/N) stays on the device so gathers need no host-to-device copy (unless ``offload_param``).
  "nvme": masters, gradient slices and optimizer state go to files, a chunk of them resident while the optimizer
  steps. ``offload_param`` without ``offload_optimizer`` changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from zero_strategy.config import OffloadDevice, ZeroConfig
from zero_strategy.core.comm.engine_comms import ARENA_CAP_BYTES, ARENAS
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.precision_names import COMPUTE_DTYPES, normalize_precision
from zero_strategy.core.plan.units import choose_unit_modules, plan_units
from zero_strategy.core.stage import ZeroStage
from zero_strategy.estimate.activations import measure_activation_bytes

OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,  # exp_avg + exp_avg_sq
    "adam": 8,
    "sgd": 4,  # momentum_buffer
    "sgd-no-momentum": 0,
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg (momentum or centered=True add 4 each)
}
"""Optimizer state bytes per parameter, with fp32 masters (the state has the masters' dtype)."""


def _optimizer_bytes(optimizer: str) -> int:
    if optimizer.lower() not in OPTIMIZER_STATE_BYTES:
        known = ", ".join(f"{k} ({v} B/param)" for k, v in OPTIMIZER_STATE_BYTES.items())
        raise ValueError(f"optimizer={optimizer!r} is not known to the estimator; known optimizers: {known}")
    return OPTIMIZER_STATE_BYTES[optimizer.lower()]


_DEFAULT = ZeroConfig()  # the engine's defaults (unit threshold, prefetch, nvme chunk), read from one place

# (stage, offload_optimizer, offload_param), cheapest first: no offload before offload, cpu before nvme, lower
# stage before higher (less communication)
CONFIGURATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
    (1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"),
    (1, "nvme", "none"), (2, "nvme", "none"), (3, "nvme", "none"), (3, "nvme", "nvme"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Placed:
    """Bytes on the compute device, in host memory and in offload files ("nvme")."""

    device: int = 0
    host: int = 0
    nvme: int = 0

    def __add__(self, other: Placed) -> Placed:
        return Placed(self.device + other.device, self.host + other.host, self.nvme + other.nvme)

    @property
    def total(self) -> int:
        return self.device + self.host + self.nvme


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Per-rank bytes of one configuration, by category and place (see the module docstring for each rule)."""

    stage: int
    precision: str  # normalized: "32-true", "bf16-mixed" or "16-mixed"
    world_size: int
    offload_optimizer: str  # "none", "cpu" or "nvme"
    offload_param: str
    optimizer: str  # a key of OPTIMIZER_STATE_BYTES
    num_params: int
    parameters: Placed  # compute-dtype copies (stage 3: the units whole at the peak)
    master: Placed  # fp32 slices not aliasing the parameters
    gradients: Placed  # at their peak: end of backward (stage 1: end of the accumulation window)
    optimizer_state: Placed
    communication: Placed  # transient reduce / gather-source buffers of the largest unit
    activations: Placed  # saved for backward by one forward of sample_batch (0 when not measured)
    notes: tuple[str, ...] = ()

    @property
    def categories(self) -> dict[str, Placed]:
        return {
            "parameters": self.parameters, "master": self.master, "gradients": self.gradients,
            "optimizer": self.optimizer_state, "comm": self.communication, "activations": self.activations,
        }  # fmt: skip

    @property
    def total(self) -> Placed:
        return sum(self.categories.values(), Placed())

    @property
    def label(self) -> str:
        offload = (("opt", self.offload_optimizer), ("param", self.offload_param))
        return " ".join([f"zero{self.stage}", *(f"{what}→{where}" for what, where in offload if where != "none")])

    def fits(self, device_memory_bytes: float, host_memory_bytes: float | None = None) -> bool:
        """Whether this rank's device bytes (and host bytes, when a host budget per rank is given) fit."""
        host_ok = host_memory_bytes is None or self.total.host <= host_memory_bytes
        return self.total.device <= device_memory_bytes and host_ok


# ------------------------------------------------------------------------------------------ model description
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


def _unit_flats(named: list[tuple[str, nn.Parameter]], keep_fp32: set[int], dtype: torch.dtype) -> list[FlatSpec]:
    """Group a unit's parameters as ``ZeroUnit`` does: one FlatParam per (dtype, compute dtype, trained)."""
    kinds: dict[tuple[torch.dtype, torch.dtype, bool], int] = {}
    for _, param in named:
        floating = param.is_floating_point() and id(param) not in keep_fp32
        compute = dtype if floating and dtype != torch.float32 else param.dtype
        key = (param.dtype, compute, param.requires_grad)
        kinds[key] = kinds.get(key, 0) + param.numel()
    return [FlatSpec(numel, compute, stored, trained) for (stored, compute, trained), numel in kinds.items()]


def describe_model(
    model: nn.Module, precision: str = "32-true", unit_modules: Sequence[str] = (), min_unit_numel: int | None = None
) -> ModelShape:
    """The FlatParams and units ``ZeroEngine`` would build for ``model`` (works on a ``meta``-device model)."""
    dtype = COMPUTE_DTYPES[normalize_precision(precision)]
    threshold = _DEFAULT.min_unit_numel if min_unit_numel is None else min_unit_numel
    plans = plan_units(model, choose_unit_modules(model, list(unit_modules), threshold))
    keep_fp32 = MixedPrecisionPolicy(dtype).full_precision_params(model) if dtype != torch.float32 else set()
    units = {plan.name: tuple(_unit_flats(plan.named_params, keep_fp32, dtype)) for plan in plans}
    others = [flats for name, flats in units.items() if name]
    largest = max(others, key=lambda flats: sum(f.numel for f in flats), default=())
    num_params = sum(f.numel for flats in units.values() for f in flats)
    return ModelShape(tuple(f for flats in units.values() for f in flats), units.get("", ()), largest, num_params)


def guess_unit_numel(num_params: int) -> int:
    """A transformer block's size for a model known only by its parameter count: Ψ ≈ 12·L·d² with d ≈ 128·L (the
    aspect ratio of GPT-3, Llama-7B/65B), one block = Ψ/L. Llama-65B: 0.94e9 guessed, 0.81e9 real."""
    layers = max(1.0, (num_params / (12 * 128**2)) ** (1 / 3))
    return min(num_params, math.ceil(num_params / layers))


def _count_shape(num_params: int, dtype: torch.dtype, largest: int | None, root: int | None) -> ModelShape:
    unit = min(num_params, largest if largest is not None else guess_unit_numel(num_params))
    # without a model the root (embeddings, head) is assumed as large as a block: conservative for most LLMs
    root_numel = min(num_params - unit, root if root is not None else unit)
    flat = FlatSpec(num_params, dtype, torch.float32, True)
    root_specs = (FlatSpec(root_numel, dtype, torch.float32, True),) if root_numel > 0 else ()
    guessed = largest is None or root is None
    return ModelShape((flat,), root_specs, (FlatSpec(unit, dtype, torch.float32, True),), num_params, guessed)


# ------------------------------------------------------------------------------------------------ the arithmetic
@dataclass(frozen=True, slots=True)
class _Setup:
    """One configuration, as the engine would run it."""

    world_size: int
    stage: ZeroStage
    reduce_dtype: torch.dtype | None  # None: in the compute dtype (no mixed-precision policy)
    offload_optimizer: OffloadDevice
    offload_param: OffloadDevice
    state_bytes: int  # per fp32 master element
    prefetch: bool
    nvme_chunk_numel: int
    accelerator: bool  # the compute device is not the host (a GPU)
    network: bool  # collectives="point_to_point": no shared-memory gathers or reductions

    @property
    def shared_reductions(self) -> bool:
        """CPU ranks (assumed on one x86-64 host) reduce through ``ARENAS`` shared-memory arenas of the largest
        flattened gradient each, held for the whole run (see [Note: shared-memory reductions]); not stage 3 with
        offload."""
        offloaded = self.offload_optimizer is not OffloadDevice.none or self.offload_param is not OffloadDevice.none
        one_host_cpus = not self.accelerator and self.world_size > 1 and not self.network
        return one_host_cpus and not (self.stage.reshards_parameters and offloaded)

    @property
    def shared_parameters(self) -> bool:
        """Stage 3 on CPU ranks (assumed on one host) without offload: each unit's parameters once per host in
        shared memory, this rank owning one slice, read in place (see [Note: shared-memory gathers])."""
        one_host_cpus = not self.accelerator and self.world_size > 1 and not self.network
        return self.stage.reshards_parameters and one_host_cpus and not self.has_placement

    @property
    def has_placement(self) -> bool:
        """The engine builds a ``Placement`` (and never aliases the master) once anything is offloaded."""
        return OffloadDevice.none is not self.offload_optimizer or OffloadDevice.none is not self.offload_param

    @property
    def device_source(self) -> bool:
        """Offloaded masters, parameters not offloaded, on a GPU: a compute-dtype slice copy stays on the device."""
        offloaded = self.offload_optimizer is not OffloadDevice.none
        return self.accelerator and offloaded and self.offload_param is OffloadDevice.none

    def aliases(self, flat: FlatSpec) -> bool:
        """The master slice is a view of the parameters when both have one dtype and nothing is offloaded: of
        ``full`` at stages 1/2, of the rank's slice of the shared buffer at stage 3 on one host."""
        same_dtype = flat.compute_dtype == flat.master_dtype
        kept_whole = not self.stage.reshards_parameters or self.shared_parameters
        return kept_whole and same_dtype and not self.has_placement

    def master_at(self, nbytes: int) -> Placed:
        if self.offload_optimizer is OffloadDevice.nvme:
            return Placed(nvme=nbytes)
        return Placed(host=nbytes) if self.offload_optimizer is OffloadDevice.cpu else Placed(device=nbytes)

    def grad_slice_at(self, nbytes: int) -> Placed:
        # cpu offload: piece.grad is created on the master's device (host); nvme: in a file of its own
        if self.offload_optimizer is OffloadDevice.nvme:
            return Placed(nvme=nbytes)
        return Placed(device=nbytes) if self.offload_optimizer is OffloadDevice.none else Placed(host=nbytes)


def _parameters(shape: ModelShape, s: _Setup) -> Placed:
    n = s.world_size
    if s.shared_parameters:  # this rank's slice of each shared buffer; the peers' slices are theirs
        return Placed(device=sum(f.shard(n) * f.compute_dtype.itemsize for f in shape.flats))
    device = sum(f.padded(n) * f.compute_dtype.itemsize for f in shape.flats)
    if s.stage.reshards_parameters:  # root + the unit computing (+ the next, prefetched), never more than the model
        whole = shape.root + shape.largest * (2 if s.prefetch else 1)
        device = min(device, sum(f.padded(n) * f.compute_dtype.itemsize for f in whole))
    if s.device_source:
        device += sum(f.shard(n) * f.compute_dtype.itemsize for f in shape.flats)
    return Placed(device=device)


def _master(shape: ModelShape, s: _Setup) -> Placed:
    nbytes = sum(f.shard(s.world_size) * f.master_dtype.itemsize for f in shape.flats if not s.aliases(f))
    return s.master_at(nbytes)


def _gradients(shape: ModelShape, s: _Setup) -> Placed:
    trained = [f for f in shape.flats if f.trainable]
    if not s.stage.reduces_every_microstep:  # full gradients until the step: .grad in fp32, else the padded fp32 stash
        return Placed(device=sum(4 * (f.numel if f.compute_dtype == torch.float32 else f.padded(s.world_size))
                                 for f in trained))  # fmt: skip
    return s.grad_slice_at(sum(f.shard(s.world_size) * f.master_dtype.itemsize for f in trained))


def _optimizer_state(shape: ModelShape, s: _Setup) -> Placed:
    masters = sum(f.shard(s.world_size) * f.master_dtype.itemsize for f in shape.flats if f.trainable)
    state = s.master_at(masters * s.state_bytes // 4)  # the state has the masters' dtype
    if s.offload_optimizer is OffloadDevice.nvme:  # one chunk of masters + gradients + state resident while it steps
        state = state + Placed(host=min(4 * s.nvme_chunk_numel, masters) * (4 + 4 + s.state_bytes) // 4)
    return state


def _gather_staging(f: FlatSpec, s: _Setup) -> int:
    """Bytes of the temporary an all-gather sends from: stages 1/2 clone an aliasing slice (a gather must not read
    the buffer it writes); otherwise the slice is converted/moved to the compute dtype and device unless it already
    is there or a device copy is kept."""
    shard = f.shard(s.world_size)
    if s.shared_parameters:  # nothing is gathered
        return 0
    if s.aliases(f):
        return shard * f.master_dtype.itemsize
    if s.device_source:
        return 0
    moved = s.accelerator and s.offload_optimizer is not OffloadDevice.none
    return shard * f.compute_dtype.itemsize if moved or f.compute_dtype != f.master_dtype else 0


def _reduce_buffers(f: FlatSpec, s: _Setup) -> int:
    """The flat reduce buffer (stage 1 in mixed precision reuses its fp32 stash when reducing in fp32) and the
    reduce-scatter output."""
    n = s.world_size
    r = (s.reduce_dtype or f.compute_dtype).itemsize
    stash_reused = not s.stage.reduces_every_microstep and f.compute_dtype != torch.float32 and r == 4
    in_arena = s.shared_reductions and f.padded(n) * r <= ARENA_CAP_BYTES  # flattened into an arena (below)
    return (0 if stash_reused or in_arena else f.padded(n) * r) + f.shard(n) * r


def _communication(shape: ModelShape, s: _Setup) -> Placed:
    unit = max((shape.root, shape.largest), key=lambda flats: sum(f.numel for f in flats))
    nbytes = sum(_gather_staging(f, s) + (_reduce_buffers(f, s) if f.trainable else 0) for f in unit)
    if s.shared_reductions:  # the arenas, each sized for the largest flattened gradient under the cap
        n = s.world_size
        sizes = [f.padded(n) * (s.reduce_dtype or f.compute_dtype).itemsize
                 for f in shape.root + shape.largest if f.trainable]  # fmt: skip
        nbytes += ARENAS * max([size for size in sizes if size <= ARENA_CAP_BYTES], default=0)
    if s.stage.reduces_every_microstep:  # .grad of the unit being finished and of the root (its gradient lands last)
        nbytes += sum(f.numel * f.compute_dtype.itemsize for f in shape.largest + shape.root if f.trainable)
    return Placed(device=nbytes)


def _notes(shape: ModelShape, s: _Setup, activations_known: bool) -> tuple[str, ...]:
    offloaded = s.offload_optimizer is not OffloadDevice.none
    prefetched = " + the prefetched one" if s.prefetch else ""
    candidates = (
        (any(s.aliases(f) for f in shape.flats) and not s.shared_parameters,
         "fp32 stages 1/2: the master slice is a view of the parameters"),
        (not s.stage.reduces_every_microstep,
         "stage 1 keeps full-size fp32 gradients until the step (paper: 2Ψ in mixed precision)"),
        (s.stage.reshards_parameters and not s.shared_parameters,
         f"stage 3: root unit + the unit computing{prefetched} are whole in forward/backward"),
        (s.shared_parameters, "stage 3 on one host's CPUs: each unit's parameters once per host in shared memory, "
         "this rank's slice (cΨ/N) its own and, in fp32, its master slice"),
        (s.device_source, "offloaded masters on a GPU: a compute-dtype copy of the slice (cΨ/N) stays on the device"),
        (s.offload_optimizer is OffloadDevice.nvme, "nvme: masters, gradient slices and optimizer state in files; "
         "one chunk of them is resident while stepping"),
        (s.offload_param is not OffloadDevice.none and not offloaded,
         "offload_param without offload_optimizer: the slices stay on the device (no effect)"),
        (shape.guessed_units, "unit sizes guessed from a transformer shape: pass largest_unit_numel / root_unit_numel"),
        (not activations_known, "activations not included: pass a model and sample_batch (or activation_bytes)"),
    )
    return tuple(text for applies, text in candidates if applies)


# ------------------------------------------------------------------------------------------------- public API
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
    min_unit_numel: int = _DEFAULT.min_unit_numel
    prefetch: bool = _DEFAULT.prefetch
    reduce_dtype: torch.dtype = torch.float32  # mixed precision only (ZeroPrecision's reduce_dtype)
    nvme_chunk_numel: int = _DEFAULT.nvme_chunk_numel
    compute_device: str = "cuda"  # "cpu": the offloaded slices already are where the compute is (no device copy)
    # "point_to_point": CPU ranks gather and reduce through the network, as when asked for or when /dev/shm lacks
    # room under "auto" (see ZeroConfig.collectives); "auto": through shared memory where a run would use it
    collectives: str = "auto"

    def __post_init__(self) -> None:
        if self.collectives not in ("auto", "point_to_point"):
            raise ValueError(f"collectives={self.collectives!r}: use 'auto' or 'point_to_point'")


def _prepare(model_or_param_count: nn.Module | float, o: EstimateOptions) -> tuple[ModelShape, int | None]:
    """The model's shape and activations: what every configuration of one comparison shares."""
    dtype = COMPUTE_DTYPES[normalize_precision(o.precision)]
    _optimizer_bytes(o.optimizer)  # an unknown name fails before any measurement
    if not isinstance(model_or_param_count, nn.Module):
        if o.sample_batch is not None:
            raise ValueError("sample_batch needs a model to run: pass the nn.Module, not a parameter count")
        psi = round(float(model_or_param_count))
        if psi < 1:
            raise ValueError(f"the parameter count must be positive, got {model_or_param_count!r}")
        return _count_shape(psi, dtype, o.largest_unit_numel, o.root_unit_numel), o.activation_bytes
    model = model_or_param_count
    shape = describe_model(model, o.precision, o.unit_modules, o.min_unit_numel)
    if o.largest_unit_numel is not None:
        shape = replace(shape, largest=(FlatSpec(o.largest_unit_numel, dtype, torch.float32, True),))
    if o.root_unit_numel is not None:
        shape = replace(shape, root=(FlatSpec(o.root_unit_numel, dtype, torch.float32, True),))
    activations = o.activation_bytes
    if activations is None and o.sample_batch is not None:
        activations = measure_activation_bytes(model, o.sample_batch, o.precision, o.loss_fn)
    return shape, activations


def _estimate(
    prepared: tuple[ModelShape, int | None], o: EstimateOptions, world_size: int, stage: int, offload: tuple[str, str]
) -> MemoryEstimate:
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    # ZeroConfig refuses what a run would refuse (offload_param below stage 3, nvme params without nvme masters)
    config = ZeroConfig(stage=stage, offload_optimizer=OffloadDevice(offload[0]),
                        offload_param=OffloadDevice(offload[1]), nvme_path="<estimate>")  # fmt: skip
    shape, activations = prepared
    precision = normalize_precision(o.precision)
    mixed = COMPUTE_DTYPES[precision] != torch.float32
    setup = _Setup(
        world_size=world_size, stage=config.zero_stage, reduce_dtype=o.reduce_dtype if mixed else None,
        offload_optimizer=config.offload_optimizer, offload_param=config.offload_param,
        state_bytes=_optimizer_bytes(o.optimizer), prefetch=o.prefetch, nvme_chunk_numel=o.nvme_chunk_numel,
        accelerator=o.compute_device != "cpu", network=o.collectives == "point_to_point",
    )  # fmt: skip
    return MemoryEstimate(
        stage=stage, precision=precision, world_size=world_size, offload_optimizer=config.offload_optimizer.value,
        offload_param=config.offload_param.value, optimizer=o.optimizer.lower(), num_params=shape.num_params,
        parameters=_parameters(shape, setup), master=_master(shape, setup), gradients=_gradients(shape, setup),
        optimizer_state=_optimizer_state(shape, setup), communication=_communication(shape, setup),
        activations=Placed(device=activations or 0), notes=_notes(shape, setup, activations is not None),
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
