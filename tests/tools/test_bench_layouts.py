"""Smoke test of ``python -m benchmarks.bench_layouts``: the tiny preset, every layout, read from the printed table
(the figures the README quotes come from the same script at ``--params 5m``)."""

from __future__ import annotations

import pytest
from helpers.bench_report import table_rows

from benchmarks.bench_layouts import main


@pytest.mark.timeout(90)
def test_layout_table_reports_every_layout_against_ddp(capsys):
    report = main(["--params", "tiny", "--steps", "1", "--warmup", "1"])
    assert report in capsys.readouterr().out
    rows = {name: cells for name, cells in table_rows(report, "layout").items() if name != "layout"}
    assert list(rows) == ["ddp", "zero3 flat", "zero3 hybrid K=2", "zero3 hierarchical"]
    assert rows["ddp"][2] == "1.00x" and all(float(cells[1]) > 0 for cells in rows.values())
    for name, cells in rows.items():  # model state per rank against its theory (the walk is exact up to padding)
        assert abs(float(cells[4].rstrip("x")) - 1.0) < 0.02, (name, cells[4])
    inter = {name: float(cells[6]) for name, cells in rows.items() if name != "ddp"}
    assert inter["zero3 hybrid K=2"] < inter["zero3 hierarchical"] < inter["zero3 flat"]
    assert "not the network time" in report
