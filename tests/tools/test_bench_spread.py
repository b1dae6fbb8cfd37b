"""The benchmark's per-repetition table pairs each method with the floor and DDP of the same repetition."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers.bench_report import table_rows

from benchmarks.bench_spread import repetition_medians, repetition_table


@dataclass
class Timed:
    method: str
    step_times: list[float] = field(default_factory=list)


def timed(method: str, *repetitions: tuple[float, float, float]) -> Timed:
    return Timed(method, [time for repetition in repetitions for time in repetition])


def test_ratios_are_taken_inside_each_repetition() -> None:
    # The machine is twice as slow in the second repetition: every method's pooled median would mix the two
    # speeds, while inside each repetition zero2 is 1.10x and then 1.20x the floor.
    floor = timed("single_process", (1.0, 1.0, 1.2), (2.0, 2.0, 2.4))
    ddp = timed("ddp", (1.3, 1.3, 1.3), (2.6, 2.6, 2.6))
    zero2 = timed("zero2", (1.1, 1.1, 1.0), (2.4, 2.4, 9.9))  # medians 1.1 and 2.4: one outlier step ignored
    assert repetition_medians(zero2.step_times, 3) == [1.1, 2.4]

    rows = table_rows("\n".join(repetition_table([floor, ddp, zero2], steps=3)))

    assert rows["zero2"][1] == "1.150 (1.100 to 1.200)"  # to the floor
    assert rows["zero2"][2] == "0.885 (0.846 to 0.923)"  # to DDP: 1.1 / 1.3 and 2.4 / 2.6
    assert rows["zero2"][3] == "1.100 1.200"
    assert rows["single_process"][1] == "—" and rows["ddp"][2] == "—"


def test_no_table_from_one_repetition_or_without_a_reference() -> None:
    one_repetition = [timed("single_process", (1.0, 1.0, 1.0)), timed("zero2", (1.1, 1.1, 1.1))]
    assert repetition_table(one_repetition, steps=3) == []
    no_reference = [timed("zero1", (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)), timed("zero2", (1.1, 1.1, 1.1), (1, 1, 1))]
    assert repetition_table(no_reference, steps=3) == []
