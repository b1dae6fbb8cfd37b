"""``python -m benchmarks.bench_layouts``: stage-3 layouts across 2 "nodes" against DDP on the same ranks.

Four CPU ranks (gloo, one intra-op thread each) launched as 2 nodes × 2 (``LOCAL_WORLD_SIZE=2``, what torchrun sets
with ``--nnodes=2 --nproc_per_node=2``) train the benchmark GPT (:mod:`benchmarks.bench_model`) with SGD under DDP,
flat ZeRO-3, hybrid sharding (``shard_group_size=2``: one shard group per node) and hierarchical stage 3
(``hierarchical_params="node"``). Per layout: the median step time and its ratio to DDP's, this rank's model state
(``memory_report``) beside its theory, and the bytes rank 0 sent per optimizer step inside its node and across nodes.

Both "nodes" are processes on one host: a byte "across nodes" costs what a byte inside one does, so the ratios show
each layout's overhead (more exchanges, copies), never the network time it saves on a real cluster; the byte columns
are what the layouts change there. One run, no repetitions: read the ratios with the machine's load in mind.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from benchmarks.bench_model import PRESETS, build_model, lm_loss, parameter_count, rank_batches
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import memory_report
from zero_strategy.core.plan.topology import INTER_NODE, INTRA_NODE
from zero_strategy.testing import run_ranks

WORLD, PER_NODE = 4, 2
LAYOUTS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "zero3 flat": {},
    "zero3 hybrid K=2": {"shard_group_size": 2},
    "zero3 hierarchical": {"hierarchical_params": "node"},
}


def theory_state_bytes(layout: str, padded: int) -> float:
    """fp32 SGD with momentum, ``padded`` elements: DDP holds parameters, gradients and momentum whole (3Ψ); flat
    ZeRO-3 1/N of each; hybrid 1/K; hierarchical flat's 3Ψ/N plus its Ψ/K secondary copy."""
    per = {"ddp": 3, "zero3 flat": 3 / WORLD, "zero3 hybrid K=2": 3 / PER_NODE,
           "zero3 hierarchical": 3 / WORLD + 1 / PER_NODE}[layout]
    return 4 * padded * per


def layout_worker(rank: int, world: int, layout: str, preset: str, steps: int, warmup: int) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    shape = PRESETS[preset]
    model = build_model(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    options = LAYOUTS[layout]
    engine = None if options is None else ZeroEngine(model, [optimizer], ZeroConfig(stage=3, **options))
    forward = DistributedDataParallel(model) if engine is None else model
    times = []
    for index, tokens in enumerate(rank_batches(shape, warmup + steps, shape.batch, shape.seq, rank, world)):
        if engine is not None and index == warmup:
            engine.comm_log.reset()
        start = time.perf_counter()
        optimizer.zero_grad()
        lm_loss(forward, tokens).backward()
        if engine is None:
            optimizer.step()
        else:
            engine.optimizer_step(optimizer)
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"ms": 1e3 * statistics.median(times[warmup:]), "psi": parameter_count(model)}
    if engine is None:
        out["state"] = sum(4 * 3 * p.numel() for p in model.parameters())
        out["padded"] = out["psi"]
    else:
        links = engine.comm_log.bytes_by_link
        out.update(state=memory_report(engine).total, intra=links.get(INTRA_NODE, 0) / steps,
                   inter=links.get(INTER_NODE, 0) / steps,
                   padded=sum(flat.layout.padded_numel for flat in engine.flat_params))
        engine.release()
    return out


def format_table(rows: dict[str, dict[str, Any]], command: str) -> str:
    ddp_ms = rows["ddp"]["ms"]
    psi = rows["ddp"]["psi"]
    lines = [
        f"{WORLD} CPU ranks as 2 nodes x {PER_NODE}, Ψ = {psi:,} parameters, SGD fp32, torch {torch.__version__}",
        f"command: {command}",
        "",
        "| layout | step ms | vs DDP | model state / rank | vs theory | intra-node MiB/step | inter-node MiB/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, row in rows.items():
        theory = theory_state_bytes(layout, row["padded"])
        intra = f"{row['intra'] / 2**20:.2f}" if "intra" in row else "-"
        inter = f"{row['inter'] / 2**20:.2f}" if "inter" in row else "-"
        lines.append(f"| {layout} | {row['ms']:.1f} | {row['ms'] / ddp_ms:.2f}x | {row['state'] / 2**20:.2f} MiB | "
                     f"{row['state'] / theory:.3f}x | {intra} | {inter} |")
    lines += ["", "Two \"nodes\" on one host: the step-time ratios show each layout's overhead, not the network time "
              "it saves; the inter-node bytes are what changes on a real cluster."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="5m", choices=sorted(PRESETS), help="model size preset")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    args = parser.parse_args(argv)
    rows = {}
    for layout in LAYOUTS:
        ranks = run_ranks(layout_worker, WORLD, layout, args.params, args.steps, args.warmup, timeout_s=900)
        rows[layout] = ranks[0] | {"ms": max(r["ms"] for r in ranks)}  # a step ends when the slowest rank's does
    command = "python -m benchmarks.bench_layouts " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = format_table(rows, command.strip())
    print(report)
    return report


if __name__ == "__main__":
    main()
