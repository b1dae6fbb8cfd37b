"""The table of the paths users run: each Trainer/Fabric row over Lightning's DDP and over the engine-level row of
the same method, both taken inside each repetition, with the range over the repetitions."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers.bench_report import table_rows

from benchmarks.bench_paths import engine_twin, paths_table


@dataclass
class Result:
    method: str
    step_times: list[float] = field(default_factory=list)
    peak_rss: int = 3 * 2**20
    state: tuple[int, int, int] = (2**20, 2**20, 2 * 2**20)
    failure: str | None = None


def timed(method: str, *repetitions: tuple[float, float, float]) -> Result:
    return Result(method, [time for repetition in repetitions for time in repetition])


def test_each_path_row_is_compared_inside_each_repetition() -> None:
    # the second repetition runs at half the speed: only ratios inside a repetition compare like with like
    lightning_ddp = timed("trainer_ddp", (1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    zero2 = timed("zero2", (0.7, 0.7, 0.7), (1.6, 1.6, 1.6))
    trainer_zero2 = timed("trainer_zero2", (0.8, 0.8, 5.0), (1.6, 1.6, 1.6))  # medians 0.8 and 1.6
    fabric_zero3 = timed("fabric_zero3", (0.9, 0.9, 0.9), (1.8, 1.8, 1.8))  # no zero3 row in this run
    failed = Result("trainer_fsdp", failure="needs a GPU")

    lines = paths_table([lightning_ddp, zero2, trainer_zero2, fabric_zero3, failed], steps=3)
    rows = table_rows("\n".join(lines))

    assert list(rows) == ["trainer_ddp", "trainer_zero2", "fabric_zero3", "trainer_fsdp"]  # engine rows are not listed
    assert rows["trainer_zero2"][2] == "0.80x (0.80 to 0.80)"  # 0.8 / 1.0 and 1.6 / 2.0
    assert rows["trainer_zero2"][3] == "1.07x (1.00 to 1.14) to zero2"  # 0.8 / 0.7 and 1.6 / 1.6
    assert rows["trainer_zero2"][4] == "3.00 MiB" and rows["trainer_zero2"][5] == "4.00 MiB"
    assert rows["fabric_zero3"][2] == "0.90x (0.90 to 0.90)" and rows["fabric_zero3"][3] == "—"
    assert rows["trainer_ddp"][2] == "—"
    assert rows["trainer_fsdp"][1] == "n/a (needs a GPU)"


def test_engine_twins_and_no_table_without_a_path_row() -> None:
    assert engine_twin("trainer_zero1") == "zero1" and engine_twin("fabric_ddp") == "ddp"
    assert engine_twin("trainer_fsdp2") == "fsdp2_reshard_true" and engine_twin("trainer_fsdp") is None
    assert engine_twin("zero1") is None
    assert paths_table([timed("zero1", (1.0, 1.0, 1.0)), timed("ddp", (1.0, 1.0, 1.0))], steps=3) == []
