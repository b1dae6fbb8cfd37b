"""What reading ``p.grad`` costs under ZeRO (see [Note: p.grad as under DDP] in core/engine/ddp_gradients.py),
measured: per stage, one step's bytes per collective kind (counted by the engine's transports where they move
them) and the peak resident memory above the step's start (the kernel's VmHWM), for a step that reads no
gradient and for one that reads every ``p.grad`` once (Lightning's ``grad_norm`` over the module), and the
milliseconds of the step. Two CPU ranks, ZeroEngine, AdamW.

    python -m benchmarks.bench_grad_reads [--params 5m] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from lightning.pytorch.utilities import grad_norm

from benchmarks.bench_model import PRESETS, build_model, lm_loss, parameter_count, rank_batches
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.process_memory import reset_peak, status_bytes
from zero_strategy.testing import run_ranks

WORLD = 2


def _measure(rank: int, world: int, params: str, stage: int, reads: bool, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    shape = PRESETS[params]
    model = build_model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    batches = rank_batches(shape, steps + 1, shape.batch, shape.seq, rank, world)
    peaks, times = [], []
    for index, tokens in enumerate(batches):
        if index == 1:
            engine.comm_log.reset()  # the first step is a warm-up
        baseline = reset_peak()
        start = time.perf_counter()
        lm_loss(model, tokens).backward()
        if reads:
            grad_norm(model, 2)  # every p.grad once, as a logging hook does
        engine.optimizer_step(optimizer)
        optimizer.zero_grad()
        if index >= 1:
            times.append(time.perf_counter() - start)
            peaks.append(status_bytes("VmHWM") - baseline)
    log = {kind: value // steps for kind, value in engine.comm_log.snapshot().items()}
    engine.release()
    return {"bytes": log, "peak": max(peaks), "ms": 1000 * statistics.median(times), "psi": parameter_count(model)}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_grad_reads", description=__doc__.split("\n")[0])
    parser.add_argument("--params", choices=sorted(PRESETS), default="5m")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    lines = [f"reading p.grad: {args.params} preset, {WORLD} CPU ranks, per step (median of {args.steps})", "",
             "| stage | p.grad read | all_gather MiB | reduce_scatter MiB | all_reduce KiB | peak RSS above start MiB "
             "| ms |",
             "|---|---|---|---|---|---|---|"]
    psi = 0
    for stage in (1, 2, 3):
        for reads in (False, True):
            rank0 = run_ranks(_measure, WORLD, args.params, stage, reads, args.steps, timeout_s=600)[0]
            psi, sent = rank0["psi"], rank0["bytes"]
            lines.append(
                f"| zero{stage} | {'every parameter' if reads else 'none'} | {sent.get('all_gather', 0) / 2**20:.1f} | "
                f"{sent.get('reduce_scatter', 0) / 2**20:.1f} | {sent.get('all_reduce', 0) / 2**10:.1f} | "
                f"{rank0['peak'] / 2**20:.1f} | {rank0['ms']:.0f} |")
    lines += ["", f"Ψ = {psi:,} parameters; 4Ψ = {4 * psi / 2**20:.1f} MiB (the fp32 gradients a read gathers)."]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
