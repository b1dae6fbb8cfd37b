"""The benchmark's per-repetition table: each method against the floor and DDP measured in the same repetition.

Why a second view of the same step times: the main table pools every timed step of every repetition, so a slow
period of the machine that hits one method's repetition more than another's moves the ratios between the pooled
medians. The methods of one repetition run back to back, so a ratio taken inside one repetition cancels much of
that drift, and the spread of those ratios over the repetitions is the error bar of a "x % above the floor"
figure on a shared machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Protocol

from benchmarks.bench_methods import FLOOR

REFERENCES = (FLOOR, "ddp", "trainer_ddp")


class TimedResult(Protocol):
    """What this table reads of a method's result (``bench_report.MethodResult``)."""

    method: str
    step_times: list[float]


def repetition_medians(step_times: Sequence[float], steps: int) -> list[float]:
    """The median step time of each repetition; ``step_times`` holds ``steps`` entries per repetition, in order."""
    return [statistics.median(step_times[start : start + steps]) for start in range(0, len(step_times), steps)]


def repetition_ratios(method: TimedResult, reference: TimedResult, steps: int) -> list[float]:
    """``method``'s median over ``reference``'s, one per repetition both completed."""
    ours = repetition_medians(method.step_times, steps)
    theirs = repetition_medians(reference.step_times, steps)
    return [a / b for a, b in zip(ours, theirs, strict=False)]


def _summary(ratios: list[float]) -> str:
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f} to {max(ratios):.3f})"


def repetition_table(results: Sequence[TimedResult], steps: int) -> list[str]:
    """Lines of the table (empty with fewer than two repetitions or without a floor or DDP row)."""
    by_name = {result.method: result for result in results if result.step_times}
    references = [by_name[name] for name in REFERENCES if name in by_name]
    repetitions = max((len(result.step_times) // steps for result in by_name.values()), default=0)
    if not references or repetitions < 2:
        return []
    first = references[0]
    header = [
        "method",
        *(f"to {ref.method}: median (lowest to highest)" for ref in references),
        f"each repetition, to {first.method}",
    ]
    lines = [
        f"Per repetition ({repetitions}): a method's median step over the median step of the floor / DDP in the same "
        "repetition (the methods of one repetition ran back to back), then the median and range over repetitions:",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for result in by_name.values():
        cells = [result.method]
        for ref in references:
            cells.append("—" if ref is result else _summary(repetition_ratios(result, ref, steps)))
        each = repetition_ratios(result, first, steps) if result is not first else []
        cells.append(" ".join(f"{ratio:.3f}" for ratio in each) or "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines
