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
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from benchmarks.bench_deepspeed_nvme import measure_in_subprocess
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine

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


Timing = tuple[int, list[float]]
DS_CPU_ADAM = "DeepSpeed CPUAdam (in memory, AdamW mode)"
DS_NVME = "DeepSpeed ZeRO-3 offload_optimizer nvme (its CPU Adam)"


def _rate(timing: Timing) -> float:
    """Millions of elements per second, from the median step."""
    return timing[0] / statistics.median(timing[1]) / 1e6


def _one_round(params: int, steps: int, nvme_path: str) -> dict[str, float | str]:
    """Every setting once, in table order: ``"<row>/<default|fused>"`` → M elements/s, or why a peer row cannot
    run here."""
    rates: dict[str, float | str] = {}
    for name, options in _configs(nvme_path).items():
        for fused in (False, True):
            rates[f"{name}/{'fused' if fused else 'default'}"] = _rate(time_step(params, options, fused, steps))
            gc.collect()
            os.sync()  # the nvme rows' dirty file pages are written back now, not during the next row's timing
    cpu_adam = time_deepspeed_cpu_adam(params, steps)
    rates[f"{DS_CPU_ADAM}/fused"] = cpu_adam if isinstance(cpu_adam, str) else _rate(cpu_adam)
    swapped = measure_in_subprocess(params, steps)
    rates[f"{DS_NVME}/fused"] = swapped if isinstance(swapped, str) else _rate(swapped)
    gc.collect()
    return rates


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_optimizer_step", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--params", type=float, default=100e6, help="parameters (default 100e6)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting and round")
    parser.add_argument("--reps", type=int, default=3,
                        help="rounds; each times every row once, in turn, so that a slow spell of a shared machine "
                             "falls on every row alike (the table shows the median round)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the benchmark's ranks use 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    psi = sum(p.numel() for p in _model(int(args.params)).parameters())
    rounds: list[dict[str, float | str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-nvme-") as nvme_path:
        for _ in range(args.reps):
            rounds.append(_one_round(int(args.params), args.steps, nvme_path))

    def median(key: str) -> float | str:
        values = [entry[key] for entry in rounds]
        numbers = [value for value in values if isinstance(value, float)]
        return statistics.median(numbers) if len(numbers) == len(values) else next(
            value for value in values if isinstance(value, str))

    lines = [f"torch {torch.__version__}, {args.threads} thread(s), AdamW, Ψ = {psi:,}; each rate from the median "
             f"of {args.steps} steps, the median of {args.reps} interleaved rounds",
             "| setting | default loop M elements/s | fused M elements/s | fused / default, same setting | "
             "fused / torch alone's default loop |", "|---|---|---|---|---|"]
    reference = median(f"{next(iter(_configs('')))}/default")
    assert isinstance(reference, float)
    for name in _configs(""):
        default, fused = median(f"{name}/default"), median(f"{name}/fused")
        assert isinstance(default, float) and isinstance(fused, float)
        lines.append(f"| {name} | {default:.0f} | {fused:.0f} | {fused / default:.2f}x | {fused / reference:.2f}x |")
    for name in (DS_CPU_ADAM, DS_NVME):
        rate = median(f"{name}/fused")
        if isinstance(rate, str):
            lines.append(f"{name}: not measured ({rate})")
        else:
            lines.append(f"| {name} | — | {rate:.0f} | — | {rate / reference:.2f}x |")
    lines.append("Every round (M elements/s): " + "; ".join(
        f"{key} " + "/".join(f"{entry[key]:.0f}" if isinstance(entry[key], float) else "-" for entry in rounds)
        for key in rounds[0]))
    report = "\n".join(lines)
    print(report, flush=True)
    return report


if __name__ == "__main__":
    main()
