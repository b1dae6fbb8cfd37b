"""The benchmark's ``torch.compile`` rows: a method with each block compiled, what dynamo did during the run, and
the table that compares compiled and eager methods measured in the same run.

Each block is compiled with ``block.compile()`` after the method is set up, the way the README recommends for ZeRO
(the stage-3 gather hooks stay outside the compiled code, see [Note: torch.compile] in
zero_strategy/core/runtime/compile_check.py). DDP gets the same compiled blocks, so the rows compare the same
compiled code; ``ddp_compile_whole`` compiles the whole model instead (``torch.compile(ddp_model)``, DDP's usual
way: one graph split at its buckets), for DDP at its best. The first warm-up step compiles; the timed steps must
compile nothing (the table shows it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.bench_counter import CollectiveCounter, MethodRun

Builder = Callable[[nn.Module, CollectiveCounter], MethodRun]


def _configure_inductor() -> None:
    # One compile thread: a pool of compile workers would fight the two ranks for the cores (and the timed steps
    # compile nothing anyway).
    torch._inductor.config.compile_threads = 1


def compiled_blocks(builder: Builder, model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    """``builder``'s method with every block of the model compiled in place."""
    _configure_inductor()
    run = builder(model, counter)
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile()
    return run


def compiled_whole(builder: Builder, model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    """``builder``'s method with the module its forward goes through (DDP's wrapper) compiled as a whole."""
    _configure_inductor()
    run = builder(model, counter)
    run.forward_module = torch.compile(run.forward_module)  # type: ignore[assignment]
    return run


def dynamo_counts() -> dict[str, int]:
    """Frames compiled so far (recompilations included), graphs produced, graph breaks, frames given up to eager."""
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "eager_frames": counters["frames"]["total"] - counters["frames"]["ok"],
    }


def compile_table(results: list[Any], ddp_ms: float | None) -> list[str]:
    """Every compiled method next to its eager twin (``zero3_compile`` next to ``zero3``), from one run.

    ``results`` are the benchmark's MethodResults; a compiled one carries ``dynamo`` (rank 0's counts at the end,
    and ``timed_frames``: frames compiled during the timed steps)."""
    by_name = {r.method: r for r in results if r.failure is None and r.step_times}
    compiled = [r for r in by_name.values() if r.dynamo]
    if not compiled:
        return []
    lines = [
        "torch.compile (each block compiled; *_compile_whole: the whole model):",
        "",
        "| method | median step ms | ratio to DDP | ratio to its eager method | ratio to ddp_compile | graphs | "
        "graph breaks | frames run eagerly | frames compiled in timed steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    compiled_ddp = by_name.get("ddp_compile")
    ddp_compile_ms = statistics.median(compiled_ddp.step_times) * 1e3 if compiled_ddp else None
    for result in compiled:
        median_ms = statistics.median(result.step_times) * 1e3
        eager = by_name.get(result.method.split("_compile")[0])
        eager_ms = statistics.median(eager.step_times) * 1e3 if eager else None
        dynamo = result.dynamo
        cells = [
            result.method, f"{median_ms:.1f}", _ratio(median_ms, ddp_ms), _ratio(median_ms, eager_ms),
            _ratio(median_ms, ddp_compile_ms), str(dynamo["graphs"]), str(dynamo["graph_breaks"]),
            str(dynamo["eager_frames"]), str(dynamo["timed_frames"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return ["", *lines]


def _ratio(value: float, reference: float | None) -> str:
    return f"{value / reference:.2f}x" if reference else "n/a"


def compute_only(params: str, reps: int, steps: int) -> list[str]:
    """What compiling the blocks can give at most: forward + backward of one process (one thread, the per-rank
    batch, no communication, no optimizer), eager against compiled blocks, interleaved over ``reps``."""
    from benchmarks.bench_model import PRESETS, build_model, lm_loss, rank_batches

    torch.set_num_threads(1)
    _configure_inductor()
    shape = PRESETS[params]
    batches = rank_batches(shape, steps + 2, shape.batch, shape.seq, 0, 1)
    lines = []
    for rep in range(reps):
        times = {}
        for compiled in (False, True):
            model = build_model(shape)
            if compiled:
                for block in model.blocks:
                    block.compile()
            samples = []
            for tokens in batches:  # the first two steps compile (forward, then backward)
                start = time.perf_counter()
                lm_loss(model, tokens).backward()
                samples.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            times[compiled] = statistics.median(samples[2:]) * 1e3
        ratio = times[True] / times[False]
        lines.append(f"rep {rep}: forward+backward eager {times[False]:.0f} ms, compiled blocks {times[True]:.0f} ms "
                     f"({ratio:.2f}x)")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_compile", description=compute_only.__doc__)
    parser.add_argument("--params", default="30m", help="model size preset (benchmarks/bench_model.py)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps after two compiling ones")
    args = parser.parse_args()
    compute_only(args.params, args.reps, args.steps)
