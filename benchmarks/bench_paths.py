"""The benchmark's table of the paths users run: each Trainer and Fabric row against Lightning's DDP and against the
engine-level row of the same method, both per repetition (the rows of one repetition ran back to back; see
benchmarks/bench_spread.py), with the peak memory per rank of the same runs."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Protocol

from benchmarks.bench_spread import repetition_ratios

LIGHTNING_DDP = "trainer_ddp"
PATH_PREFIXES = ("trainer_", "fabric_")

# the engine-level row that runs the same method without Lightning (where one exists)
_ENGINE_TWIN = {"ddp": "ddp", "fsdp2": "fsdp2_reshard_true", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}


class PathResult(Protocol):
    """What this table reads of a method's result (``bench_report.MethodResult``)."""

    method: str
    step_times: list[float]
    peak_rss: int
    state: tuple[int, int, int]
    failure: str | None


def engine_twin(method: str) -> str | None:
    """``trainer_zero2`` / ``fabric_zero2`` → ``zero2``: the engine-level row of the same method, or None."""
    for prefix in PATH_PREFIXES:
        if method.startswith(prefix):
            return _ENGINE_TWIN.get(method.removeprefix(prefix))
    return None


def _ratios(ratios: list[float]) -> str:
    if not ratios:
        return "—"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} to {max(ratios):.2f})"


def paths_table(results: Sequence[PathResult], steps: int) -> list[str]:
    """Markdown lines (empty without a Trainer or Fabric row)."""
    by_name = {r.method: r for r in results if r.failure is None and r.step_times}
    rows = [r for r in results if r.method.startswith(PATH_PREFIXES)]
    if not rows:
        return []
    reference = by_name.get(LIGHTNING_DDP)
    header = ["method", "median step ms", f"to Lightning DDP ({LIGHTNING_DDP}) per repetition: median (range)",
              "to the engine-level row per repetition: median (range)", "peak RSS / rank above baseline",
              "model state / rank"]
    lines = [
        "The paths users run: Trainer and Fabric rows, each repetition's median step over Lightning DDP's and over the "
        "engine-level row of the same method in the same repetition, then the median and range over repetitions:",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in rows:
        if row.failure is not None:
            lines.append(f"| {row.method} | n/a ({row.failure}) |" + " — |" * (len(header) - 2))
            continue
        twin_name = engine_twin(row.method)
        twin = by_name.get(twin_name) if twin_name else None
        to_ddp = repetition_ratios(row, reference, steps) if reference is not None else []
        to_engine = repetition_ratios(row, twin, steps) if twin is not None else []
        cells = [
            row.method,
            f"{statistics.median(row.step_times) * 1e3:.1f}",
            "—" if row is reference else _ratios(to_ddp),
            f"{_ratios(to_engine)} to {twin_name}" if twin is not None else "—",
            f"{row.peak_rss / 2**20:.2f} MiB",
            f"{sum(row.state) / 2**20:.2f} MiB",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
