"""``python -m benchmarks.bench_optimizer_step``: elements per second of the offloaded CPU optimizer step.

One process (world size 1: the rank steps its whole slice), a stack of square ``nn.Linear`` layers of about
``--params`` parameters, the user's ``torch.optim.AdamW(...)``. For each offload setting (``zero2_offload``: masters
and state in host memory; ``zero3_offload_nvme``: in files, stepped in chunks) it times ``engine.step`` with
``fused_optimizer=True`` (torch's fused kernel) against ``fused_optimizer=False`` (torch's default: the per-tensor
loop on CPU), on the same gradients, after one untimed step that creates the optimizer state. The first row is
the reference: the same model and optimizer without ZeRO (``optimizer.step()`` on the layers' own tensors, torch's
default loop and ``fused=True``); the last column divides each fused rate by that row's default-loop rate. Where
DeepSpeed is installed and its CPU Adam op builds, a row times ``DeepSpeedCPUAdam`` on the same layers (its
C++ kernel, in memory) as the peer's reference rate, and where its async_io op builds too (libaio), a last row
times DeepSpeed's own NVMe optimizer offload, the peer's counterpart of ``zero3_offload_nvme`` (see
benchmarks/bench_deepspeed_nvme.py).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch
from torch import nn

from benchmarks.bench_deepspeed_nvme import time_deepspeed_nvme_step
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine import ZeroEngine

WIDTH = 2048  # one layer: 4.2 M parameters


def _model(params: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(max(1, params // (WIDTH * WIDTH + WIDTH)))))


def _configs(nvme_path: str) -> dict[str, dict[str, object]]:
    return {
        "no ZeRO (torch alone)": {},
        "zero2_offload": {"stage": 2, "offload_optimizer": "cpu"},
        "zero3_offload_nvme": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                               "nvme_path": nvme_path},
    }


def _time_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> tuple[int, list[float]]:
    """(Ψ, seconds of each timed ``optimizer.step()`` on the model's own tensors), after one untimed step."""
    model(torch.randn(1, WIDTH)).sum().backward()
    optimizer.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return sum(p.numel() for p in model.parameters()), times


def time_plain_step(params: int, fused: bool, steps: int) -> tuple[int, list[float]]:
    """(Ψ, seconds of each timed ``optimizer.step()``) without ZeRO."""
    model = _model(params)
    return _time_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None), steps)


def time_deepspeed_cpu_adam(params: int, steps: int) -> tuple[int, list[float]] | str:
    """(Ψ, seconds of each timed step) of DeepSpeed's CPU Adam (AdamW mode) on the layers' own tensors, or why it
    cannot run here (DeepSpeed missing, or its C++ op does not build)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        model = _model(params)
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, adamw_mode=True)
    except Exception as error:  # ImportError, or the op's build failing (no compiler, no CPU support)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return _time_optimizer(model, optimizer, steps)


def time_step(params: int, options: dict[str, object], fused: bool, steps: int) -> tuple[int, list[float]]:
    """(Ψ, seconds of each timed ``engine.step``)."""
    if not options:
        return time_plain_step(params, fused, steps)
    model = _model(params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(fused_optimizer=fused, **options))  # type: ignore[arg-type]
    try:
        model(torch.randn(1, WIDTH)).sum().backward()
        times = []
        with engine.step_window(optimizer):  # the gradients stay on the slices for every timed step
            engine.step(optimizer)  # creates the state
            for _ in range(steps):
                start = time.perf_counter()
                engine.step(optimizer)
                times.append(time.perf_counter() - start)
        return sum(p.numel() for p in engine.master_params(optimizer)), times
    finally:
        engine.release()


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_optimizer_step", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--params", type=float, default=100e6, help="parameters (default 100e6)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the benchmark's ranks use 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [f"torch {torch.__version__}, {args.threads} thread(s), AdamW, median of {args.steps} steps",
             "| setting | Ψ | default loop M elements/s | fused M elements/s | fused / default, same setting | "
             "fused / torch alone's default loop |", "|---|---|---|---|---|---|"]
    reference = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-nvme-") as nvme_path:
        for name, options in _configs(nvme_path).items():
            rates = {}
            for fused in (False, True):
                psi, times = time_step(int(args.params), options, fused, args.steps)
                rates[fused] = psi / statistics.median(times) / 1e6
                gc.collect()
            reference = reference or rates[False]
            lines.append(f"| {name} | {psi:,} | {rates[False]:.0f} | {rates[True]:.0f} | "
                         f"{rates[True] / rates[False]:.2f}x | {rates[True] / reference:.2f}x |")
            print(lines[-1], flush=True)
    deepspeed = time_deepspeed_cpu_adam(int(args.params), args.steps)
    if isinstance(deepspeed, str):
        lines.append(f"DeepSpeed's CPU Adam not measured: {deepspeed}")
    else:
        rate = deepspeed[0] / statistics.median(deepspeed[1]) / 1e6
        lines.append(f"| DeepSpeed CPUAdam (in memory, AdamW mode) | {deepspeed[0]:,} | — | {rate:.0f} | — | "
                     f"{rate / reference:.2f}x |")
    with tempfile.TemporaryDirectory(prefix="bench-ds-nvme-") as nvme_path:
        swapped = time_deepspeed_nvme_step(_model(int(args.params)), torch.randn(1, WIDTH), args.steps, nvme_path)
    if isinstance(swapped, str):
        lines.append(f"DeepSpeed's NVMe offload not measured: {swapped}")
    else:
        rate = swapped[0] / statistics.median(swapped[1]) / 1e6
        lines.append(f"| DeepSpeed ZeRO-3 offload_optimizer nvme (its CPU Adam) | {swapped[0]:,} | — | {rate:.0f} | "
                     f"— | {rate / reference:.2f}x |")
    report = "\n".join(lines)
    print(report, flush=True)
    return report


if __name__ == "__main__":
    main()
