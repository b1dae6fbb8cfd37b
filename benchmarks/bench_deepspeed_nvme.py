"""DeepSpeed's own NVMe optimizer offload (ZeRO-Infinity), timed as the peer's reference for ``zero3_offload_nvme``
in ``python -m benchmarks.bench_optimizer_step``.

DeepSpeed swaps the fp32 masters, both Adam moments and the gradients through files with its ``async_io`` op
(libaio, ``O_DIRECT``: the page cache is bypassed), then steps each swapped-in partition with its C++ CPU Adam.
Configured as a user would: stage 3 (DeepSpeed creates an optimizer swapper only there; stage 2 with an nvme
device keeps the state in memory), ``offload_optimizer: {device: nvme}``, its default ``aio`` settings, the other
rows' AdamW hyper-parameters (lr 1e-3, weight decay 0.01), fp32, one process. Timed like our rows:
``engine.step()`` alone, after one untimed step that creates the state; each step has its own forward and
backward before it (DeepSpeed's step needs fresh gradients), which are not timed. Each measurement runs in a
process of its own (:func:`measure_in_subprocess`): DeepSpeed keeps process-group handles in module globals that a
second initialisation in the same process trips over.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def time_deepspeed_nvme_step(model: nn.Module, sample: torch.Tensor, steps: int, nvme_path: str
                             ) -> tuple[int, list[float]] | str:
    """(Ψ, seconds of each timed ``engine.step()``) of DeepSpeed's NVMe optimizer offload on ``model``, or why it
    cannot run here (DeepSpeed missing, or its async_io op not buildable: it needs libaio's headers)."""
    try:
        import deepspeed  # type: ignore[import-not-found]
        from deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[import-not-found]
    except Exception as error:  # ImportError, or DeepSpeed failing to pick an accelerator
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return "DeepSpeed's async_io op cannot build here (it needs libaio: apt-get install libaio-dev)"
    psi = sum(p.numel() for p in model.parameters())  # before DeepSpeed partitions them away
    started_here = not dist.is_initialized()
    if started_here:  # one process: DeepSpeed wants a process group all the same
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False},
        },
    }
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        times = []
        for index in range(steps + 1):
            engine.backward(engine(sample).sum())
            start = time.perf_counter()
            engine.step()
            if index > 0:  # the first step creates the state in the files
                times.append(time.perf_counter() - start)
        return psi, times
    finally:
        if started_here:
            dist.destroy_process_group()


def measure_in_subprocess(params: int, steps: int) -> tuple[int, list[float]] | str:
    """:func:`time_deepspeed_nvme_step` on bench_optimizer_step's model of ``params`` parameters, in a fresh
    process (see the module docstring)."""
    command = [sys.executable, "-m", "benchmarks.bench_deepspeed_nvme", str(params), str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"exit status {done.returncode}: {tail}"
    result = json.loads(lines[-1])
    return result if isinstance(result, str) else (int(result[0]), [float(t) for t in result[1]])


def main() -> None:
    """``python -m benchmarks.bench_deepspeed_nvme PARAMS STEPS``: prints the result as one JSON line."""
    import tempfile

    from benchmarks.bench_optimizer_step import WIDTH, _model

    torch.set_num_threads(1)  # like every row of bench_optimizer_step
    params, steps = int(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory(prefix="bench-ds-nvme-") as nvme_path:
        result = time_deepspeed_nvme_step(_model(params), torch.randn(1, WIDTH), steps, nvme_path)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
