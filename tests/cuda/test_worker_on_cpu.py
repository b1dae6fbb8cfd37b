"""The CUDA tier's scripts, proven on the CPU: the worker (torchrun, gloo) runs every kind of scenario it runs on a
GPU, and benchmarks/gpu_check.py runs its whole pipeline on the tiny model and fails fast without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.torchrun import ROOT, torchrun

sys.path.insert(0, str(ROOT))  # `benchmarks` is a folder of the repository, not an installed package

from benchmarks import gpu_check


@pytest.mark.timeout(120)
def test_worker_scenarios_run_on_cpu_ranks(tmp_path: Path) -> None:
    """Two gloo ranks: parity in every precision and offload, the sync-free steps (no debug mode on a CPU), a save;
    then one rank resumes it (another world size and stage)."""
    scenarios = ["parity:1:fp32", "parity:3:bf16", "parity:2:fp16", "parity:3:fp32:cpu", "parity:2:fp32:nvme",
                 "sync:3:bf16", f"save:3:{tmp_path}"]
    torchrun(2, "cpu", scenarios, timeout_s=100)
    torchrun(1, "cpu", [f"resume:2:{tmp_path}"], timeout_s=60)


@pytest.mark.timeout(120)
def test_gpu_check_report_pipeline_runs_on_cpu(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
               "--report", str(report)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    text = report.read_text()
    for method in gpu_check.METHODS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {method} |"))
        assert "failed" not in row and float(row.split("|")[2].replace(",", "")) > 0, row
    assert "MFU" in text and "n/a" in text  # no peak for a CPU: MFU is not made up
    assert text in result.stdout


def test_gpu_check_fails_fast_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA GPU visible"):
        gpu_check.init("cuda")


def test_mfu_uses_the_named_peak_only() -> None:
    assert gpu_check.peak_tflops("NVIDIA H200") == 989.0
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_check.peak_tflops("Some Other GPU") is None
