"""The CUDA tier (issue 14): ZeRO on real GPUs, launched with torchrun. Collected everywhere, skipped without a GPU;
``make gpu-check`` runs it (``pytest -m cuda tests/cuda``). Its worker is proven on the CPU by
tests/cuda/test_worker_on_cpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.torchrun import torchrun

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="CUDA tier: no CUDA GPU visible (torch.cuda.is_available() is False); run `make gpu-check` on a GPU",
    ),
]

PARITY = [f"parity:{stage}:{precision}" for stage in (1, 2, 3) for precision in ("fp32", "bf16", "fp16")]
OFFLOAD = ["parity:2:fp32:cpu", "parity:3:bf16:cpu", "parity:2:fp32:nvme", "parity:3:fp32:nvme"]
SYNC_FREE = ["sync:1:bf16", "sync:2:bf16", "sync:3:bf16", "sync:3:fp32"]


@pytest.mark.timeout(600)
def test_every_stage_precision_and_offload_on_one_gpu() -> None:
    torchrun(1, "cuda", PARITY + OFFLOAD + SYNC_FREE, timeout_s=540)


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CUDA tier: needs two GPUs")
def test_every_stage_precision_and_offload_on_two_gpus() -> None:
    torchrun(2, "cuda", PARITY + OFFLOAD + SYNC_FREE, timeout_s=540)


@pytest.mark.timeout(600)
def test_checkpoint_saved_on_gpu_resumes_on_cpu_ranks_and_the_reverse(tmp_path: Path) -> None:
    torchrun(1, "cuda", [f"save:3:{tmp_path / 'a'}"], timeout_s=240)
    torchrun(2, "cpu", [f"resume:2:{tmp_path / 'a'}"], timeout_s=240)
    torchrun(2, "cpu", [f"save:1:{tmp_path / 'b'}"], timeout_s=240)
    torchrun(1, "cuda", [f"resume:3:{tmp_path / 'b'}"], timeout_s=240)


@pytest.mark.timeout(600)
def test_lightning_fit_and_resume_on_gpus(tmp_path: Path) -> None:
    """The adapter on GPUs: strategy (NCCL barrier), precision plugin (CUDA autocast, fp16 scaling), profiler (CUDA
    event timing), sharded checkpoint IO and resume (the rank's own CUDA generator); the resumed fit's updates are
    held to an uninterrupted DDP fit's with the same precision flag."""
    gpus = min(2, torch.cuda.device_count())
    runs = [f"lightning:{stage}:{precision}:{tmp_path / str(stage)}" for stage, precision in
            ((1, "fp32"), (2, "fp16"), (3, "bf16"))]
    torchrun(gpus, "cuda", runs, timeout_s=540)
