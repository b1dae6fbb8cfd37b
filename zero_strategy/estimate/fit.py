"""Set-up and training peaks per rank, and the largest model a machine trains: ``zero-estimate --largest``.

Set-up is the engine's constructor (building the FlatParams, then giving them values); training is the steady
state that :mod:`.memory` itemizes. The set-up arithmetic mirrors ``core/engine/build.py`` (a ``FlatStorage``
per FlatParam) and ``core/init/materialize.py``; Ψ = parameters, N = ranks, p = the parameters' bytes (fp32: 4),
c = compute bytes, U = the largest unit:

- every run ends set-up holding the compute copies (stages 1/2: ``full``, cΨ; stage 3 built on meta: nothing) and
  the master slices pΨ/N (none at fp32 stages 1/2 without offload: they alias ``full``).
- eager build (the model exists in pΨ before the engine): each unit's fp32 ``full`` is made beside the module's
  own tensors, which are freed as their parameters are re-pointed at it, so the peak is pΨ + the slices + one
  unit's fp32 buffer (p·U) and, in mixed precision, its compute copy (c·U). Stage 3 keeps every unit whole until
  the end of set-up (``release_gathered``), which is why an eager stage 3 set-up peaks at a whole replica.
- built on meta (``record_construction`` / ``configure_model``): nothing but the buffers above plus what the replay
  holds at once (about the largest single tensor; stages 1/2 in mixed precision: one unit's fp32 + compute copy).
- nvme: the slices are file pages written during set-up; they stay resident until the first gather releases them,
  so they count as host memory here.

Not modelled: the interpreter, allocator and process-group baseline (measure above it), and a set-up's constant
bookkeeping (tens of MiB: the recording, gloo's buffers). ``benchmarks/bench_largest.py`` compares both peaks
with measured resident memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from zero_strategy.estimate.memory import (
    CONFIGURATIONS,
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    Placed,
    describe_model,
    estimate_memory,
)
from zero_strategy.estimate.tensor_parallel import TensorParallel

HEADROOM = 0.15  # the share of RAM (and disk) the largest-model search leaves free


@dataclass(frozen=True, slots=True)
class Peaks:
    """One configuration's per-rank peaks: set-up (the engine's constructor) and training (:mod:`.memory`)."""

    estimate: MemoryEstimate
    setup: Placed
    meta_init: bool

    @property
    def training(self) -> Placed:
        return training_peak(self.estimate)

    def ram(self, compute_on_host: bool) -> int:
        """Bytes of host memory at the worse of the two peaks (the device's too when the ranks compute on CPUs)."""
        phases = (self.setup, *training_phases(self.estimate))
        return max(_ram(phase, compute_on_host) for phase in phases)

    def training_ram(self, compute_on_host: bool) -> int:
        return max(_ram(phase, compute_on_host) for phase in training_phases(self.estimate))

    def device(self) -> int:
        return max(self.setup.device, self.training.device)


def training_phases(e: MemoryEstimate) -> tuple[Placed, ...]:
    """What is resident at the training peak(s) per rank: the estimate's total, except with nvme offload, where
    forward/backward and the optimizer step peak at different times (see [Note: the nvme step's peak])."""
    if e.offload_optimizer != "nvme":
        return (e.total,)
    state_bytes = OPTIMIZER_STATE_BYTES[e.optimizer]
    chunk = e.optimizer_state.host  # one chunk's masters + gradients + state, resident while it steps
    fresh = chunk * state_bytes // (8 + state_bytes)  # the first step's new state, in memory beside its file copy
    files = Placed(nvme=e.master.nvme + e.optimizer_state.nvme)
    step = e.gradients + Placed(host=chunk + fresh) + files  # the masters are in `files`
    compute = e.parameters + e.communication + e.activations + e.gradients + files
    return compute, step


def training_peak(e: MemoryEstimate) -> Placed:
    """Each place's training peak (on a GPU the device and the host may peak in different phases)."""
    phases = training_phases(e)
    return Placed(*(max(getattr(p, place) for p in phases) for place in ("device", "host", "nvme")))


# [Note: the nvme step's peak]
# With nvme offload the masters and optimizer state live in files and the step runs chunk by chunk, so the two
# large transient sets never meet: forward/backward holds the gathered units and the reduce buffers, the step holds
# one chunk's masters, gradients and state (pages of the files) and, at the first step, that chunk's new state as
# AdamW creates it in memory before it is copied into its file (so 4 + 4 + 2 x 8 bytes per chunk element with
# AdamW, not 4 + 4 + 8). The gradient slices are in a file too; only the unit being reduced has its pages mapped.


def _ram(placed: Placed, compute_on_host: bool) -> int:
    return placed.host + (placed.device if compute_on_host else 0)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the set-up arithmetic needs beyond the estimate: Ψ by FlatParam and the largest tensor."""

    padded: int  # Σ padded FlatParam elements at this world size
    shard: int  # Σ this rank's slice elements
    largest_unit: int  # elements of the largest unit (root included)
    largest_tensor: int  # elements of the largest single parameter


def setup_peak(
    e: MemoryEstimate, facts: ModelFacts, *, meta_init: bool, accelerator: bool = False, param_bytes: int = 4
) -> Placed:
    """Per-rank bytes at the peak of the engine's set-up (see the module docstring); ``accelerator``: the ranks
    compute on GPUs (the module and ``full`` on the device, offloaded slices in host memory)."""
    c = 4 if e.precision == "32-true" else 2
    offloaded = e.offload_optimizer != "none" or e.offload_param != "none"
    keeps_full = e.stage < 3
    full = c * facts.padded if keeps_full or not meta_init else 0
    slices = 0 if keeps_full and c == param_bytes and not offloaded else param_bytes * facts.shard
    host = slices if e.offload_optimizer != "none" else 0  # host memory (cpu) or resident file pages (nvme)
    device = full + (slices - host)
    if accelerator and not keeps_full and e.offload_optimizer != "none" and e.offload_param == "none":
        device += c * facts.shard  # the compute-dtype copy of offloaded slices kept beside the parameters
    unit_buffers = facts.largest_unit * (param_bytes + (c if c != param_bytes else 0))
    if meta_init:  # the replay holds about one tensor; stages 1/2 in mixed precision convert one unit at a time
        device += max(param_bytes * facts.largest_tensor, unit_buffers if keeps_full and c != param_bytes else 0)
    else:  # the module's own tensors, replaced unit by unit by `full`: whichever is larger, plus one unit
        device += max(param_bytes * e.num_params - full, 0) + unit_buffers
    return Placed(device=device, host=host)


# ------------------------------------------------------------------------------------------- the model's facts
@dataclass(frozen=True, slots=True)
class GPTShape:
    """A GPT of ``benchmarks/bench_model.py``'s layout, by counts alone: token + position embeddings, ``n_layer``
    pre-norm blocks of width ``width`` (attention + 4× MLP, biases, two LayerNorms), a final LayerNorm and an
    output layer tied to the token embedding. The embeddings count as the root unit (whole through a stage-3
    forward/backward), as planned when they are below ``min_unit_numel``; above it each is its own unit, and the
    root then is an overestimate by a few units' worth of small terms."""

    n_layer: int
    width: int
    vocab: int
    max_seq: int

    @property
    def block(self) -> int:
        d = self.width
        return 12 * d * d + 13 * d  # qkv 3d²+3d, proj d²+d, fc_in 4d²+4d, fc_out 4d²+d, 2 LayerNorms 4d

    @property
    def root(self) -> int:
        return (self.vocab + self.max_seq + 2) * self.width  # embeddings and the final LayerNorm

    @property
    def num_params(self) -> int:
        return self.n_layer * self.block + self.root

    @property
    def largest_tensor(self) -> int:
        return max(self.vocab, 4 * self.width) * self.width  # the embedding, or an MLP weight


@dataclass(frozen=True, slots=True)
class GPTFamily:
    """GPTs of one aspect ratio: ``width = width_per_layer × n_layer`` (GPT-3 and Llama: about 128)."""

    width_per_layer: int = 64
    vocab: int = 50257
    max_seq: int = 1024

    def __post_init__(self) -> None:
        if min(self.width_per_layer, self.vocab, self.max_seq) < 1:
            raise ValueError(f"GPTFamily needs positive width_per_layer, vocab and max_seq, got {self}")

    def member(self, n_layer: int) -> GPTShape:
        return GPTShape(n_layer, self.width_per_layer * n_layer, self.vocab, self.max_seq)


Subject = nn.Module | float | GPTShape


def model_facts(subject: Subject, world_size: int, **options: Any) -> ModelFacts:
    """The set-up arithmetic's view of a model (planned as the engine would), a GPT shape or a bare count (units
    guessed as in :mod:`.memory`; the largest tensor then assumed as large as a unit: conservative). With
    ``tensor_parallel``: one TP rank's part, sharded over the data-parallel ranks."""
    tp = TensorParallel(size=options.get("tensor_parallel", 1), fraction=options.get("tp_fraction"))
    world_size = tp.data_parallel_size(world_size)
    if isinstance(subject, nn.Module):
        keys = ("precision", "unit_modules", "min_unit_numel")  # how the engine would plan the units
        local = tp.local_numel(subject)
        shape = describe_model(subject, **{key: options[key] for key in keys if key in options}, local_numel=local)
        unit = max(sum(f.numel for f in flats) for flats in (shape.root, shape.largest))
        biggest = max((local(p) for p in subject.parameters()), default=0)
        padded = sum(f.padded(world_size) for f in shape.flats)
        return ModelFacts(padded, sum(f.shard(world_size) for f in shape.flats), unit, biggest)
    if isinstance(subject, GPTShape):
        unit, psi, biggest = max(subject.block, subject.root), subject.num_params, subject.largest_tensor
    else:
        from zero_strategy.estimate.memory import guess_unit_numel

        psi = round(float(subject))
        unit = min(psi, options.get("largest_unit_numel") or guess_unit_numel(psi))
        biggest = unit
    psi, unit, biggest = tp.local_count(psi), tp.local_count(unit), tp.local_count(biggest)
    return ModelFacts(psi, -(-psi // world_size), unit, biggest)


def compare_peaks(
    subject: Subject, *, world_size: int, meta_init: bool = True, **options: Any
) -> list[Peaks]:  # fmt: skip
    """Set-up and training peaks of every configuration (:data:`CONFIGURATIONS`); ``options``: those of
    :func:`.memory.estimate_memory` (``compute_device="cpu"``: the ranks compute on CPUs)."""
    accelerator = options.get("compute_device", "cuda") != "cpu"
    if isinstance(subject, GPTShape):
        options = {"largest_unit_numel": subject.block, "root_unit_numel": subject.root, **options}
        counted: nn.Module | float = subject.num_params
    else:
        counted = subject
    facts = model_facts(subject, world_size, **options)
    peaks = []
    for stage, opt, par in CONFIGURATIONS:
        e = estimate_memory(counted, world_size=world_size, stage=stage, offload_optimizer=opt, offload_param=par,
                            **options)  # fmt: skip
        setup = setup_peak(e, facts, meta_init=meta_init, accelerator=accelerator)
        peaks.append(Peaks(e, setup, meta_init))
    return peaks


# ---------------------------------------------------------------------------------------- the largest that fits
@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """One node's budget: ``ram`` and ``disk`` (the nvme path's free space) shared by ``ranks_per_node`` ranks;
    ``device_memory`` per GPU, or None when the ranks compute on CPUs (then their device bytes are RAM)."""

    ram: float | None = None
    disk: float | None = None
    device_memory: float | None = None
    ranks_per_node: int = 1
    headroom: float = HEADROOM

    def __post_init__(self) -> None:
        if self.ram is None and self.device_memory is None:
            raise ValueError("a machine needs ram= (CPU ranks) or device_memory= (GPUs) to fit a model into")
        if not 0 <= self.headroom < 1 or self.ranks_per_node < 1:
            raise ValueError(f"headroom must be in [0, 1) and ranks_per_node ≥ 1, got {self}")

    def fits(self, peaks: Peaks) -> bool:
        usable, ranks = 1 - self.headroom, self.ranks_per_node
        on_host = self.device_memory is None
        if self.ram is not None and ranks * peaks.ram(on_host) > usable * self.ram:
            return False
        if self.device_memory is not None and peaks.device() > usable * self.device_memory:
            return False
        nvme = max(peaks.setup.nvme, peaks.training.nvme)
        return nvme == 0 or (self.disk is not None and ranks * nvme <= usable * self.disk)


def _largest_index(fits: Callable[[int], bool], high: int) -> int:
    """The largest k in [1, high] with fits(k), for fits monotone (true, then false); 0 when none fits."""
    if not fits(1):
        return 0
    lo, hi = 1, high  # fits(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@dataclass(frozen=True, slots=True)
class Largest:
    """The largest model of one configuration that fits a machine: its peaks, and its shape for a family."""

    peaks: Peaks | None  # None: not even the smallest fits
    shape: GPTShape | None = None


def largest_fitting(
    machine: Machine, *, world_size: int, family: GPTFamily | None = None, meta_init: bool = True,
    **options: Any,
) -> list[Largest]:  # fmt: skip
    """For every configuration, the largest model that fits ``machine``: the largest member of ``family``, or
    without one the largest parameter count (units guessed). ``options``: those of :func:`compare_peaks`."""
    if machine.device_memory is None:
        options = {**options, "compute_device": "cpu"}
    results = []
    for index in range(len(CONFIGURATIONS)):

        def peaks_of(size: int, index: int = index) -> Peaks:
            subject: Subject = family.member(size) if family is not None else float(size)
            return compare_peaks(subject, world_size=world_size, meta_init=meta_init, **options)[index]

        high = 4096 if family is not None else 10**15
        best = _largest_index(lambda size: machine.fits(peaks_of(size)), high)
        shape = family.member(best) if family is not None and best else None
        results.append(Largest(peaks_of(best) if best else None, shape))
    return results


def parse_family(spec: str, kwargs: dict[str, Any] | None = None) -> GPTFamily:
    """``--family gpt`` (with optional keywords): the only family so far."""
    if spec.lower() != "gpt":
        raise ValueError(f"unknown model family {spec!r}: the known one is 'gpt' (keywords: width_per_layer, vocab, "
                         "max_seq)")
    try:
        return GPTFamily(**(kwargs or {}))
    except TypeError as error:
        raise ValueError(f"--family gpt: {error}") from None


def ratios(measured: Sequence[float], predicted: Sequence[float]) -> list[float]:
    """measured / predicted, for the benchmark's table (inf where nothing was predicted)."""
    return [m / p if p else math.inf for m, p in zip(measured, predicted, strict=True)]
