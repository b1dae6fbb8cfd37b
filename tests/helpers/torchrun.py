"""Launching the CUDA tier's worker with torchrun (CUDA cannot be used in forked children), on any device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "cuda" / "worker.py"
ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, device: str, scenarios: list[str], timeout_s: float) -> str:
    """Run ``scenarios`` on ``nproc`` ranks of ``device``; fail with the ranks' output unless every one passed."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(WORKER), "--device", device, "--scenarios", ",".join(scenarios),
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun {device} x{nproc} failed (rc {result.returncode}):\n{output[-6000:]}"
    missing = [spec for spec in scenarios if f"ok {spec}" not in result.stdout]
    assert not missing, f"scenarios without an ok line: {missing}\n{output[-6000:]}"
    return output
