"""The CUDA tier's scripts, proven on the CPU: the worker (torchrun, gloo) runs every kind of scenario it runs on a
GPU, and benchmarks/gpu_check.py runs its whole pipeline on the tiny model and fails fast without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.torchrun import ROOT, torchrun

from zero_strategy.testing import free_port

sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of the repository, not an installed package

from benchmarks import gpu_check


@pytest.mark.timeout(180)
def test_worker_scenarios_run_on_cpu_ranks(tmp_path: Path) -> None:
    """One launch of two gloo ranks (a launch costs seconds of imports): parity in each precision, with CPU and nvme
    offload, the sync-free steps (no debug mode on a CPU), a save and its resume at another stage, and the Lightning
    scenario in the GPU tier's three combinations against DDP (each update held to the reference's)."""
    scenarios = ["parity:1:fp32", "parity:3:bf16:cpu", "parity:2:fp16:nvme", "sync:3:bf16",
                 f"save:3:{tmp_path}", f"resume:1:{tmp_path}"]
    scenarios += [f"lightning:{stage}:{precision}:{tmp_path / str(stage)}"
                  for stage, precision in ((1, "fp32"), (2, "fp16"), (3, "bf16"))]
    torchrun(2, "cpu", scenarios, timeout_s=160)


def test_gpu_check_report_pipeline_runs_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole pipeline in this process, as a world of one over gloo (its environment variables are undone)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    report = tmp_path / "report.md"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--report", str(report)]) == 0
    text = report.read_text()
    for method in gpu_check.METHODS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {method} |"))
        assert "failed" not in row and float(row.split("|")[2].replace(",", "")) > 0, row
    assert "Dry run on the CPU" in text and "| n/a | n/a |" in text  # no peak, no CUDA memory: nothing made up


def test_gpu_check_fails_fast_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA GPU visible"):
        gpu_check.init("cuda")


def test_mfu_uses_the_named_peak_only() -> None:
    assert gpu_check.peak_tflops("NVIDIA H200") == 989.0
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_check.peak_tflops("Some Other GPU") is None
