"""Smoke test of ``python -m benchmarks.benchmark``: the tiny preset end to end, in-process.

The ranks are forked gloo processes as in a real run; the assertions read the printed table only, so they hold
the report to what a user sees.
"""

from __future__ import annotations

import pytest
from helpers.bench_report import table_rows

from benchmarks.benchmark import main


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
