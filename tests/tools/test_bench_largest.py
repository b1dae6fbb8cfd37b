"""Smoke test of ``python -m benchmarks.bench_largest``: the tiny size end to end (fresh interpreters, 2 gloo ranks
each), read from the printed report as a user reads it."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.bench_largest import HEADER, main


def _rows(report: str) -> dict[str, list[str]]:
    rows = {}
    for line in report.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) > 2 and cells[0] == "tiny":
            rows[cells[2]] = cells
    return rows


@pytest.mark.timeout(90)
def test_tiny_run_reports_measured_peaks_beside_the_estimate(capsys, tmp_path):
    report = main(["--sizes", "tiny", "--methods", "zero3_offload_nvme,deepspeed_zero3", "--json",
                   str(tmp_path / "rows.json")])  # fmt: skip
    assert report in capsys.readouterr().out and HEADER in report
    rows = _rows(report)
    installed = importlib.util.find_spec("deepspeed") is not None
    deepspeed = rows["deepspeed_zero3"][3]
    assert deepspeed.startswith("skipped") and ("not installed" in deepspeed) != installed
    nvme = rows["zero3_offload_nvme"]
    setup, setup_predicted, train, train_predicted = (float(nvme[i].replace(",", "")) for i in (3, 4, 6, 7))
    assert 0 < setup < train and setup_predicted > 0 and train_predicted > 0
    # the files are exactly this rank's fp32 masters + AdamW state (12 bytes per element of its slice), as predicted
    disk, disk_predicted = float(nvme[9]), float(nvme[10])
    assert abs(disk - disk_predicted) <= 0.1 * disk_predicted
    assert "B/param" in report and "Estimator (zero-estimate --largest" in report
    # the saved rows print the same table again without measuring
    assert main(["--load", str(tmp_path / "rows.json"), "--sizes", "tiny"]).split("\n\n")[1] == report.split("\n\n")[1]
