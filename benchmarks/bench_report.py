"""What one benchmark run reports: each method's result (:class:`MethodResult`), what ZeRO's theory says its model
state and traffic should be, and the report's tables (apart from the runner, :mod:`benchmarks.benchmark`, which
measures and hands its results here)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from benchmarks.bench_compile import compile_table
from benchmarks.bench_methods import FLOOR
from benchmarks.bench_model import PRESETS, BenchGPT
from benchmarks.bench_paths import engine_twin, paths_table
from benchmarks.bench_phases import Phases, breakdown_table
from benchmarks.bench_spread import repetition_table

if TYPE_CHECKING:  # the runner imports this module: its options class is only named here
    from benchmarks.benchmark import BenchOptions


def theory_state_bytes(method: str, psi: int, world: int) -> float:
    """fp32 parameters (4Ψ), gradients (4Ψ), AdamW moments (8Ψ): which of them each method divides by N."""
    method = method.removeprefix("trainer_").removeprefix("fabric_")  # the same model state under Lightning
    method = method.removeprefix("deepspeed_")  # DeepSpeed's stages against the same theory as ours
    method = method.split("_compile")[0]  # compiling changes no byte of the model state
    method = method.removesuffix("_point_to_point")  # nor how the bytes travel
    if method in ("zero1", "zero_redundancy"):
        return 4 * psi + 4 * psi + 8 * psi / world
    if method == "zero2":
        return 4 * psi + 12 * psi / world
    if method in ("ddp", "ddp_fused_adamw", FLOOR):
        return 16 * psi
    return 16 * psi / world  # zero3, fsdp2


def theory_comm_bytes(method: str, psi: int) -> int:
    """All-reduce (2Ψ) or reduce-scatter + all-gather (2Ψ); a second all-gather before backward (3Ψ); torch's
    ZeroRedundancyOptimizer all-reduces (2Ψ) and then broadcasts each rank's updated partition (Ψ)."""
    method = method.removeprefix("trainer_").removeprefix("fabric_")  # the same model state under Lightning
    method = method.removeprefix("deepspeed_")  # DeepSpeed's stages against the same theory as ours
    method = method.split("_compile")[0]  # nor what is sent
    method = method.removesuffix("_point_to_point")  # nor how
    if method == FLOOR:
        return 0
    three = method in ("zero3", "zero3_block_units", "zero_redundancy", "fsdp2_reshard_true", "fsdp2", "fsdp")
    return (3 if three else 2) * psi * 4  # fp32


@dataclass(slots=True)
class MethodResult:
    """Everything measured for one method, over all repetitions."""

    method: str
    step_times: list[float] = field(default_factory=list)  # seconds, slowest rank per step, all repetitions
    failure: str | None = None
    state: tuple[int, int, int] = (0, 0, 0)  # the walk's (parameters, gradients, optimizer state), largest rank
    report_mismatch: str | None = None  # ZeRO: where memory_report disagrees with the walk
    comm: dict[str, float] = field(default_factory=dict)  # bytes per step by kind (the method's own count)
    counted: dict[str, float] = field(default_factory=dict)  # ZeRO: the dist wrappers' count, per step
    peak_rss: int = 0  # largest over ranks and repetitions
    losses: list[float] = field(default_factory=list)  # rank 0, first repetition
    dynamo: dict[str, int] = field(default_factory=dict)  # compiled methods: rank 0's dynamo counts, last repetition
    phases: Phases | None = None  # the profiled run's ms per step by phase (bench_phases)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _above_floor(median_ms: float, floor_ms: float | None, method: str) -> str:
    """The time a method spends above the single-process step, in ms and as a share of its own step."""
    if floor_ms is None or method == FLOOR:
        return "—"
    above = median_ms - floor_ms
    return f"{above:.1f} ms ({above / median_ms:.1%})"


def _row(result: MethodResult, ddp_ms: float | None, floor_ms: float | None, psi: int, world: int) -> str:
    if result.failure is not None:
        return f"| {result.method} | n/a ({result.failure}) |" + " — |" * 8
    median_ms = statistics.median(result.step_times) * 1e3
    vs_ddp = f"{median_ms / ddp_ms:.2f}x" if ddp_ms else "n/a"
    state = sum(result.state)
    state_theory = theory_state_bytes(result.method, psi, world)
    state_cell = _mib(state) + (" (memory_report disagrees!)" if result.report_mismatch else "")
    sent = sum(result.comm.values())
    comm_theory = theory_comm_bytes(result.method, psi)
    if result.counted and abs(sum(result.counted.values()) - sent) > 0.5:
        sent_cell = f"{_mib(sent)} (dist wrappers: {_mib(sum(result.counted.values()))})"
    elif comm_theory == 0:
        sent_cell = _mib(sent)
    else:
        sent_cell = f"{_mib(sent)} ({sent / comm_theory:.2f}x theory)"
    cells = [
        result.method, f"{median_ms:.1f}", vs_ddp, _above_floor(median_ms, floor_ms, result.method), state_cell,
        _mib(state_theory), f"{state / state_theory:.3f}x",
        sent_cell, _mib(comm_theory), _mib(result.peak_rss),
    ]
    return "| " + " | ".join(cells) + " |"


def _details(results: list[MethodResult], psi: int) -> list[str]:
    """Per method: the state and traffic in units of Ψ bytes, and the loss agreement with DDP."""
    reference = next((r.losses for r in results if r.method == "ddp" and r.losses), None)
    lines = []
    for result in results:
        if result.failure is not None:
            continue
        params, grads, optim = (nbytes / psi for nbytes in result.state)
        traffic = ", ".join(f"{kind} {nbytes / psi:.2f}" for kind, nbytes in sorted(result.comm.items()))
        line = f"- {result.method}: state/Ψ params {params:.2f}, grads {grads:.2f}, optimizer {optim:.2f}; "
        line += f"bytes sent/Ψ per step: {traffic or 'none'}"
        if reference and result.method not in ("ddp", FLOOR):  # the floor's ranks average nothing
            diff = max(abs(a - b) for a, b in zip(result.losses, reference, strict=True))
            line += f"; max |loss - DDP loss| over steps {diff:.1e}"
        if result.report_mismatch:
            line += f"; MEMORY_REPORT MISMATCH: {result.report_mismatch}"
        lines.append(line)
    return lines


MEASUREMENT_NOTES = """\
How to read it: step time = slowest rank per step, median over every timed step of every repetition, without the
memory walk (trainer_*: from one on_train_batch_start to the next, the whole iteration of Lightning's loop; their
model state is walked after the last timed step, when stage 1 has dropped its full gradient).
single_process = the compute floor: each rank trains its own copy of the model on its per-rank batch as a single
process would (no communication at all), AdamW(fused=True); the ranks run side by side, so the floor
shares the machine's cores and memory bandwidth as the other rows' ranks do. Time above floor = a method's median
minus the floor's, and its share of the method's step (what distribution adds: unhidden communication, sharding
bookkeeping, a slower optimizer loop; a sharded optimizer steps 1/N of the model, so a little can come back as
negative). ddp = the user's AdamW(...) (torch's default loop on CPU); ddp_fused_adamw = AdamW(fused=True);
zero* = the user's AdamW(...), which ZeRO steps with the fused kernel (fused_optimizer=True).
Model state = distinct storages of parameters, .grad and optimizer.state after the last backward (DDP with
gradient_as_bucket_view; ZeRO's figure agrees with memory_report; zero3's shared-memory parameter buffers, one per
host, count 1/N on each of its N ranks). Bytes sent = the full buffer of each
all-gather / reduce-scatter / broadcast, twice the buffer of an all-reduce (zero*: engine comm_log; ddp: comm hook;
zero_redundancy: comm hook + torch.distributed wrappers; fsdp2: wrappers). Peak RSS = VmHWM minus VmRSS at a reset
(/proc/self/clear_refs) just before the model is built, each run in fresh processes, largest rank and repetition."""


def format_report(options: BenchOptions, results: list[MethodResult], command: str) -> str:
    shape = PRESETS[options.params]
    with torch.device("meta"):
        psi = sum(p.numel() for p in BenchGPT(shape).parameters())
    ddp = next((r for r in results if r.method == "ddp" and r.failure is None), None)
    ddp_ms = statistics.median(ddp.step_times) * 1e3 if ddp else None
    floor = next((r for r in results if r.method == FLOOR and r.failure is None), None)
    floor_ms = statistics.median(floor.step_times) * 1e3 if floor else None
    by_name = {r.method: r for r in results if r.failure is None and r.step_times}
    header = [
        "method", "median step ms", "ratio to DDP", "time above floor", "model state / rank", "theory",
        "ratio to theory",
        "bytes sent / step", "theory", "peak RSS / rank above baseline",
    ]
    lines = [
        f"command: {command}",
        f"torch {torch.__version__}, {options.world_size} ranks (gloo, 1 thread each), model {options.params}: "
        f"Ψ = {psi:,} fp32 parameters, {shape.n_layer} blocks of width {shape.width}, vocab {shape.vocab_size}; "
        f"batch {options.batch} x seq {options.seq} per rank; AdamW; {options.reps} reps x "
        f"({options.warmup} warm-up + {options.steps} timed steps) per method, interleaved",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *(_row(result, ddp_ms, floor_ms, psi, options.world_size) for result in results),
        "",
        *compile_table(results, ddp_ms),
        "",
        *repetition_table([r for r in results if r.failure is None], options.steps),
        "",
        *paths_table(results, options.steps),
        "",
        *breakdown_table(
            {r.method: r.phases for r in results if r.phases is not None},
            {r.method: statistics.median(by_name[twin].step_times) * 1e3 for r in results
             if (twin := engine_twin(r.method) or r.method) in by_name and r.phases is not None},
        ),
        "",
        *_details(results, psi),
        "",
        MEASUREMENT_NOTES,
    ]
    return "\n".join(lines)
