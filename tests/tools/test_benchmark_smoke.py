"""Smoke test of ``python -m benchmarks.benchmark``: the tiny preset end to end, in-process.

The ranks are forked gloo processes as in a real run; the assertions read the printed table only, so they hold
the report to what a user sees.
"""

from __future__ import annotations

import pytest
from helpers.bench_report import table_rows

from benchmarks.benchmark import QUICK_METHODS, main, parse_args


def _mib(cell: str) -> float:
    value, unit = cell.split()[:2]
    assert unit == "MiB", cell
    return float(value)


@pytest.mark.timeout(120)
def test_tiny_benchmark_reports_ddp_and_zero3(capsys):
    report = main(["--params", "tiny", "--reps", "1", "--steps", "2", "--methods", "ddp,zero3"])

    assert report in capsys.readouterr().out
    assert "torch " in report and "python -m benchmarks.benchmark --params tiny" in report
    rows = table_rows(report)
    assert sorted(rows) == ["ddp", "zero3"]
    for method, cells in rows.items():
        assert "n/a" not in cells[1], f"{method} failed: {cells[1]}"
        assert float(cells[1]) > 0
    ddp_state, zero3_state = _mib(rows["ddp"][4]), _mib(rows["zero3"][4])
    assert 0 < zero3_state < ddp_state
    # each measured state is its theory (the walk is exact up to AdamW's scalar `step` tensors and padding)
    for cells in rows.values():
        assert cells[6].endswith("x") and abs(float(cells[6][:-1]) - 1.0) < 0.05
    assert "MISMATCH" not in report and "disagrees" not in report


@pytest.mark.timeout(300)  # 14 tiny runs (2 repetitions of 5 methods, 4 profiled), about 40 s here when loaded
def test_tiny_benchmark_runs_the_trainer_and_fabric_paths_beside_the_engine(capsys):
    methods = ["ddp", "zero2", "trainer_ddp", "trainer_zero2", "fabric_zero2"]
    report = main(["--params", "tiny", "--reps", "2", "--steps", "2", "--methods", ",".join(methods)])

    rows = table_rows(report)
    assert sorted(rows) == sorted(methods)
    for method, cells in rows.items():
        assert "n/a" not in cells[1], f"{method} failed: {cells[1]}"
        assert abs(float(cells[6][:-1]) - 1.0) < 0.05, (method, cells[6])  # model state: its theory
    for method in ("trainer_ddp", "trainer_zero2", "fabric_zero2"):  # the same training as the engine's DDP
        details = next(line for line in report.splitlines() if line.startswith(f"- {method}: "))
        assert float(details.rsplit(" ", 1)[1]) < 1e-4, details

    paths = table_rows(report[report.index("The paths users run"):])
    assert list(paths) == ["trainer_ddp", "trainer_zero2", "fabric_zero2"]
    assert paths["trainer_zero2"][3].endswith("to zero2") and paths["trainer_ddp"][3].endswith("to ddp")
    assert paths["fabric_zero2"][2].endswith(")") and "n/a" not in paths["fabric_zero2"][2]

    phases = table_rows(report[report.index("Where each step's time goes"):], "phase")
    header = next(line for line in report.splitlines() if line.startswith("| phase |"))
    assert header.split("|")[2:-1] == [" zero2 ", " trainer_ddp ", " trainer_zero2 ", " fabric_zero2 "]
    # Lightning's loop runs in the Trainer columns only; every column has a backward
    assert [cell != "—" for cell in phases["loop: SIGTERM flag broadcast (Lightning, world > 1)"][1:]] == [
        False, True, True, False]
    assert all(cell != "—" for cell in phases["compute: backward (autograd, with ZeRO's backward hooks)"][1:])
    # the engine's phases in every ZeRO column; Lightning's DDP has no ZeRO engine
    assert [cell != "—" for cell in phases["engine: publish (gather / barriers)"][1:]] == [True, False, True, True]


def test_quick_picks_the_headline_rows_unless_told_otherwise() -> None:
    quick = parse_args(["--quick"])
    assert quick.methods == QUICK_METHODS and (quick.reps, quick.steps) == (2, 3)
    assert {"trainer_ddp", "trainer_zero1", "fabric_zero3", "zero2"} <= set(quick.methods)
    told = parse_args(["--quick", "--reps=4", "--methods", "zero1,trainer_zero1"])
    assert told.methods == ["zero1", "trainer_zero1"] and (told.reps, told.steps) == (4, 3)
    assert parse_args([]).reps == 3 and "fabric_zero2" in parse_args([]).methods
