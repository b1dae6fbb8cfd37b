"""``python -m benchmarks.benchmark``: step time, model-state memory, traffic and peak RSS of ZeRO vs DDP.

One GPT-style model (:mod:`benchmarks.bench_model`) is trained on the same random tokens by every method
on ``--world-size`` CPU ranks (gloo, one intra-op thread per rank). ZeRO runs at core level (``ZeroEngine``, no
Lightning), so the comparison with DDP, ``ZeroRedundancyOptimizer`` and FSDP2 is of the sharding alone; the
``trainer_*`` and ``fabric_*`` rows run the same model through Lightning's Trainer and Fabric, as users do
(:mod:`benchmarks.bench_lightning`), and a profiled run per method breaks their steps down
(:mod:`benchmarks.bench_phases`).

[Note: what is measured, and how]  (the printed ``MEASUREMENT_NOTES`` give the definitions)
- ``for rep: for method:``, each run in fresh forked processes: the machine's speed drifts between repetitions
  (only ratios inside one run mean anything), and a fresh process has a clean allocator and its own peak RSS.
- Model state is taken after the last backward, when the optimizer state of earlier steps exists and this step's
  gradients are wherever the method keeps them until the step (stage 1: full; stage 2/3: the slice).
- An all-reduce counts twice its buffer (a reduce-scatter plus an all-gather), so every method compares with the
  ZeRO paper's 2Ψ / 3Ψ. For ZeRO the ``torch.distributed`` wrappers count too, as a cross-check of the log.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks import bench_model
from benchmarks.bench_compile import dynamo_counts
from benchmarks.bench_counter import CollectiveCounter, MethodRun
from benchmarks.bench_lightning import (
    FABRIC_STRATEGIES,
    TRAINER_STRATEGIES,
    as_launched_rank,
    build_fabric,
    is_lightning_method,
    run_trainer,
)
from benchmarks.bench_methods import BUILDERS, OPT_IN_METHODS
from benchmarks.bench_model import PRESETS, BenchGPT, build_model, lm_loss, rank_batches, warm_up_kernels
from benchmarks.bench_phases import (
    PhaseClock,
    install_adapter_timers,
    install_fabric_timers,
    install_lightning_timers,
    merge_runs,
)
from benchmarks.bench_report import MethodResult, format_report
from zero_strategy.core.engine.memory import memory_report
from zero_strategy.core.flat.access import own_grad
from zero_strategy.process_memory import reset_peak, status_bytes
from zero_strategy.testing import run_ranks

FABRIC_BUILDERS: dict[str, Callable[[nn.Module, CollectiveCounter], MethodRun]] = {
    method: functools.partial(build_fabric, method) for method in FABRIC_STRATEGIES
}
DEFAULT_METHODS = [*BUILDERS, *TRAINER_STRATEGIES, *FABRIC_BUILDERS]
# profiled for the breakdown (when in the run): ZeRO's stages at engine level, under the Trainer and under Fabric, and
# Lightning's DDP
BREAKDOWN_METHODS = (
    "trainer_ddp", *(f"{path}zero{stage}" for stage in (1, 2, 3) for path in ("", "trainer_", "fabric_"))
)
# --quick: the rows the README's headline table compares, fewer steps and repetitions
QUICK_METHODS = ["single_process", "ddp", "zero1", "zero2", "zero3", "trainer_ddp", "trainer_fsdp2",
                 *(f"{path}zero{stage}" for path in ("trainer_", "fabric_") for stage in (1, 2, 3))]
METHODS = [*DEFAULT_METHODS, *OPT_IN_METHODS]


@dataclass(kw_only=True, slots=True)
class BenchOptions:
    """What one benchmark run does (the CLI's flags)."""

    params: str = "5m"
    """Model size preset: one of ``PRESETS``."""
    reps: int = 3
    """Repetitions; every method runs once per repetition, methods interleaved."""
    steps: int = 5
    """Timed optimizer steps per (repetition, method)."""
    warmup: int = 2
    """Untimed steps before them (at least 1, so the optimizer state exists when memory is measured)."""
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    """Which methods, in this order (``OPT_IN_METHODS``, e.g. the ``*_compile`` rows, only when named)."""
    world_size: int = 2
    """Number of CPU ranks."""
    batch: int | None = None
    """Sequences per rank per step; None: the preset's."""
    seq: int | None = None
    """Tokens per sequence; None: the preset's."""
    breakdown: bool = True
    """After the timed repetitions, one profiled run of each method in ``BREAKDOWN_METHODS`` (the per-phase table)."""

    def __post_init__(self) -> None:
        if self.params not in PRESETS:
            raise ValueError(f"--params {self.params!r}: choose one of {sorted(PRESETS)}")
        unknown = [m for m in self.methods if m not in METHODS]
        deepspeed_rows = [m for m in unknown if m.startswith("deepspeed_zero")]
        if deepspeed_rows:  # registered only where DeepSpeed imports (bench_methods): say so, not "unknown"
            raise ValueError(
                f"--methods {','.join(deepspeed_rows)}: the DeepSpeed rows need DeepSpeed, which is not installed "
                "here (it is no dependency of zero_strategy); run them from a virtualenv that has it (see the "
                "README's Benchmark section)"
            )
        if unknown or not self.methods:
            raise ValueError(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
        if self.reps < 1 or self.steps < 1 or self.warmup < 1 or self.world_size < 1:
            raise ValueError("--reps, --steps, --warmup and --world-size must be at least 1")
        shape = PRESETS[self.params]
        self.batch = self.batch or shape.batch
        self.seq = self.seq or shape.seq
        if self.seq > shape.max_seq:
            raise ValueError(f"--seq {self.seq} exceeds the preset's position table ({shape.max_seq})")


def _distinct_bytes(tensors: list[Tensor], seen: set[int], sharers: dict[int, int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``; a storage in ``sharers`` (data pointer → number of ranks
    mapping the same shared memory) is one copy per host, charged 1/that to each of them."""
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes() // (sharers or {}).get(storage.data_ptr(), 1)
    return total


def walk_model_state(run: MethodRun) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes on this rank, each storage counted once, first where met."""
    if run.state_walk is not None:  # a method whose state lives where this walk cannot see it (DeepSpeed)
        return run.state_walk()
    params: dict[int, Tensor] = {id(p): p for p in run.module.parameters()}
    for group in run.optimizer.param_groups:
        params.update((id(p), p) for p in group["params"])
    seen: set[int] = set()
    # ZeRO stage 3 on one host: each unit's parameters are one shared-memory buffer mapped by every rank
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    flats = run.engine.flat_params if run.engine is not None else []
    sharers = {flat.full.untyped_storage().data_ptr(): world for flat in flats if flat.storage.full.readable_in_place}
    with torch.no_grad():
        param_bytes = _distinct_bytes(list(params.values()), seen, sharers)
        # own_grad: counting the storages is not a user's read of p.grad (which would gather the averaged copy)
        grads = [own_grad(p) for p in params.values()]
        grad_bytes = _distinct_bytes([g for g in grads if g is not None], seen)
        states = [v for s in run.state_optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        return param_bytes, grad_bytes, _distinct_bytes(states, seen)


def _walk_memory(run: MethodRun) -> dict[str, Any]:
    """The model-state walk, and the engine's own memory report to compare it with."""
    memory: dict[str, Any] = {"walk": walk_model_state(run)}
    if run.engine is not None:
        report = memory_report(run.engine)
        memory["report"] = (report.parameters, report.gradients, report.optimizer_state)
    return memory


def _train(run: MethodRun, batches: list[Tensor], warmup: int, counter: CollectiveCounter,
           clock: PhaseClock | None = None) -> dict[str, Any]:
    """``clock``: a profiled run's phase timers, started at the first timed step and stopped at the start of the last
    (whose memory walk they must not see)."""
    times: list[float] = []
    losses: list[float] = []
    memory: dict[str, Any] = {}
    frames_at_warmup = 0
    for index, tokens in enumerate(batches):
        if index == warmup:  # traffic counts from the first timed step
            frames_at_warmup = dynamo_counts()["frames"]
            dist.barrier()
            counter.bytes_by_kind.clear()
            if run.engine is not None:
                run.engine.comm_log.reset()
            if clock is not None:
                clock.start()
        if index == len(batches) - 1 and clock is not None:
            memory["phases"] = clock.stop()
            memory["phase_steps"] = len(batches) - 1 - warmup
        start = time.perf_counter()
        run.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run.forward_module, tokens)
        run.backward(loss)
        backward_done = time.perf_counter()
        if index == len(batches) - 1:  # see [Note: what is measured, and how]
            memory.update(_walk_memory(run))
            dist.barrier()  # a slower walk on one rank must not show up as the other rank's step time
        step_start = time.perf_counter()
        run.step()
        end = time.perf_counter()
        losses.append(loss.item())
        if index >= warmup:
            times.append((backward_done - start) + (end - step_start))
    dynamo = {**dynamo_counts(), "timed_frames": dynamo_counts()["frames"] - frames_at_warmup}
    return {"times": times, "losses": losses, "dynamo": dynamo, **memory}


def rank_worker(
    rank: int, world_size: int, method: str, options: BenchOptions, profile: bool = False
) -> dict[str, Any]:
    """One method on one rank of a fresh process group (run by ``run_ranks``, which sets one thread per rank).
    ``profile``: time the phases of each step instead (see benchmarks/bench_phases.py); the result's "phases"."""
    torch.set_num_threads(1)
    shape = PRESETS[options.params]
    assert options.batch is not None and options.seq is not None
    # a Trainer row runs one untimed step more: see [Note: what a Trainer row times] in bench_lightning.py
    extra = 1 if method in TRAINER_STRATEGIES else 0
    batches = rank_batches(shape, options.warmup + options.steps + extra, options.batch, options.seq, rank, world_size)
    if is_lightning_method(method):
        as_launched_rank(rank, world_size)
    warm_up_kernels()
    clock = PhaseClock() if profile else None
    if clock is not None:
        install_phase_timers(clock)
    baseline = reset_peak()
    counter = CollectiveCounter()
    counter.install()
    try:
        if method in TRAINER_STRATEGIES:
            result = run_trainer(method, shape, batches, options.warmup, counter, clock, _walk_memory)
        else:
            run = {**BUILDERS, **OPT_IN_METHODS, **FABRIC_BUILDERS}[method](build_model(shape), counter)
            result = _train(run, batches, options.warmup, counter, clock)
            if run.engine is not None:
                result["engine_log"] = run.engine.comm_log.snapshot()
        result.setdefault("counted", dict(counter.bytes_by_kind))  # a Trainer row's: before its untimed step
    finally:
        counter.remove()
        if clock is not None:
            clock.remove()
    result["peak_rss"] = status_bytes("VmHWM") - baseline
    return result


def install_phase_timers(clock: PhaseClock) -> None:
    """Every timer of bench_phases, and the benchmark's own compute: the model's forward and the loss."""
    install_lightning_timers(clock)
    install_fabric_timers(clock)
    install_adapter_timers(clock)
    clock.wrap(BenchGPT, "forward", "compute: model forward")
    clock.wrap(sys.modules[__name__], "lm_loss", "compute: loss (own lines)")
    clock.wrap(bench_model, "lm_loss", "compute: loss (own lines)")


def _absorb(result: MethodResult, ranks: list[dict[str, Any]], steps: int) -> None:
    """Fold one repetition's per-rank results into ``result``."""
    result.step_times += [max(r["times"][i] for r in ranks) for i in range(steps)]
    result.state = max((r["walk"] for r in ranks), key=sum)
    for rank, r in enumerate(ranks):
        if "report" in r and tuple(r["report"]) != tuple(r["walk"]):
            result.report_mismatch = f"rank {rank}: memory_report {r['report']} vs walk {r['walk']}"
    own = ranks[0].get("engine_log", ranks[0]["counted"])
    result.comm = {kind: nbytes / steps for kind, nbytes in own.items()}
    if "engine_log" in ranks[0]:
        result.counted = {kind: nbytes / steps for kind, nbytes in ranks[0]["counted"].items()}
    result.peak_rss = max(result.peak_rss, *(r["peak_rss"] for r in ranks))
    result.losses = result.losses or ranks[0]["losses"]
    if "_compile" in result.method:
        result.dynamo = ranks[0]["dynamo"]


def _failure_reason(error: BaseException) -> str:
    """The last line of the failing rank's traceback (the exception), shortened for a table cell."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return lines[-1].replace("|", "/")[:120]  # a "|" would split the table cell


def run_benchmark(options: BenchOptions) -> list[MethodResult]:
    """``for rep: for method:`` one fresh process group per run; a method that fails is not retried."""
    results = {method: MethodResult(method) for method in options.methods}
    for rep in range(options.reps):
        for method in options.methods:
            result = results[method]
            if result.failure is not None:
                continue
            try:
                ranks = run_ranks(rank_worker, options.world_size, method, options, timeout_s=900, pg_timeout_s=300)
            except Exception as error:  # reported in the method's row, the other methods still run
                result.failure = _failure_reason(error)
                print(f"[rep {rep}] {method}: failed: {result.failure}", file=sys.stderr, flush=True)
                continue
            _absorb(result, ranks, options.steps)
            recent = statistics.median(result.step_times[-options.steps :]) * 1e3
            print(f"[rep {rep}] {method}: median {recent:.1f} ms/step", file=sys.stderr, flush=True)
    if options.breakdown:
        _profile(options, [results[m] for m in options.methods if m in BREAKDOWN_METHODS])
    return [results[method] for method in options.methods]


def _profile(options: BenchOptions, results: list[MethodResult]) -> None:
    """One profiled run of each method (see [Note: self time per phase] in bench_phases.py), after the timed ones."""
    for result in results:
        if result.failure is not None:
            continue
        try:
            ranks = run_ranks(rank_worker, options.world_size, result.method, options, True, timeout_s=900,
                              pg_timeout_s=300)
        except Exception as error:  # the breakdown lacks this column; the timed rows stand
            print(f"[profile] {result.method}: failed: {_failure_reason(error)}", file=sys.stderr, flush=True)
            continue
        result.phases = merge_runs([r["phases"] for r in ranks], ranks[0]["phase_steps"])
        total = sum(result.phases.wall.values())
        print(f"[profile] {result.method}: {total:.1f} ms/step", file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> BenchOptions:
    defaults = BenchOptions()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.benchmark", description=__doc__.split("\n")[0])
    parser.add_argument("--params", choices=sorted(PRESETS), default=defaults.params, help="model size preset")
    parser.add_argument("--reps", type=int, default=defaults.reps, help="repetitions (methods interleaved)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per repetition and method")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps before them (>= 1)")
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated subset of {','.join(METHODS)}"
    )
    parser.add_argument("--world-size", type=int, default=defaults.world_size, help="number of CPU ranks")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default: preset's)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: preset's)")
    parser.add_argument(
        "--no-breakdown", dest="breakdown", action="store_false",
        help="skip the profiled run per Trainer/Fabric/ZeRO method after the timed ones (the per-phase table)",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help=f"the headline rows only ({','.join(QUICK_METHODS)}), 2 repetitions of 3 timed steps, unless "
        "--methods / --reps / --steps say otherwise",
    )
    args = vars(parser.parse_args(argv))  # the flags are BenchOptions' fields, but --quick
    if args.pop("quick"):
        given = {arg.split("=")[0] for arg in argv}  # "--reps 4" and "--reps=4" alike
        args["methods"] = args["methods"] if "--methods" in given else ",".join(QUICK_METHODS)
        args["reps"] = args["reps"] if "--reps" in given else 2
        args["steps"] = args["steps"] if "--steps" in given else 3
    args["methods"] = [method.strip() for method in args["methods"].split(",") if method.strip()]
    try:
        return BenchOptions(**args)
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark, print the report (command, torch version, table, details) and return it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    options = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.benchmark", *argv])
    started = time.perf_counter()
    results = run_benchmark(options)
    report = format_report(options, results, command)
    report += f"\n\nwall time of the whole benchmark: {time.perf_counter() - started:.0f} s"
    print(report, flush=True)
    return report


if __name__ == "__main__":
    main()
