"""Memory per rank of tensor parallelism x data-parallel sharding (issue 36): the Llama of
``tests/helpers/tp_llama.py`` at ~34 M parameters, 4 CPU ranks over gloo (2 data-parallel x 2 tensor-parallel),
torch's TP tutorial plan, AdamW, under Lightning's ``ModelParallelStrategy`` (FSDP2 over the data-parallel
dimension: the ``mps`` row) and ``ZeroStrategy(stage=s, tensor_parallel_size=2)`` (rows ``zero1/2/3``).

    python -m benchmarks.bench_tp --methods mps,zero1,zero2,zero3

Per rank: the peak resident memory above the baseline taken just before ``Trainer.fit`` (the module, built eagerly
in ``__init__`` on every rank as a user's would be, is already in the baseline), and the bytes of parameters,
gradients and optimizer state the rank holds at the end of the last step (``benchmarks.benchmark.walk_model_state``:
each storage once; a DTensor counts its local shard). Ratios are against the ``mps`` row. A method that fails
(``ZeroStrategy`` before it takes ``tensor_parallel_size``) prints ``n/a`` and its error.

Each method runs in a fresh interpreter whose ranks fix glibc's mmap threshold and warm up libtorch before the
baseline (as ``benchmarks/bench_setup_memory.py`` does), so no row inherits another's heap.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from benchmarks.bench_counter import MethodRun
from benchmarks.bench_model import warm_up_kernels
from benchmarks.benchmark import walk_model_state
from zero_strategy.process_memory import reset_peak, status_bytes

REPO = Path(__file__).resolve().parents[1]
# The model, its TP plan and the run settings are the ones the tests hold to a single-process reference
# (tests/lightning/test_tp_reference.py): one definition, imported from the tests' helpers.
sys.path.insert(0, str(REPO / "tests"))

from helpers.tp_llama import LlamaConfig, TPLlamaModule  # noqa: E402
from helpers.tp_runs import STRATEGIES, TPSettings, loader  # noqa: E402

MiB = 2**20
METHODS = ("mps", "zero1", "zero2", "zero3", "zero3_p2p")
SIZES = {
    # ~34 M parameters: 8 blocks of 3.2 M (attention 4 x 512^2, SwiGLU 3 x 512 x 1376), 2 x 8192 x 512 embeddings
    "34m": LlamaConfig(dim=512, n_layers=8, n_heads=8, vocab=8192, seq=64, ffn_hidden=1376),
    "tiny": LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab=128, seq=16, ffn_hidden=192),
}


class EndOfFitWalk(Callback):
    """At the end of the last step (after its optimizer step, before the next zero_grad): this rank's parameter,
    gradient and optimizer-state bytes."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.walk: tuple[int, int, int] = (0, 0, 0)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if batch_idx != self.steps - 1:
            return
        assert isinstance(pl_module, TPLlamaModule) and trainer.strategy.model is not None
        optimizer = trainer.optimizers[0]
        engine = getattr(trainer.strategy, "engine", None)
        run = MethodRun(trainer.strategy.model, pl_module.model, optimizer, optimizer.step, optimizer, engine)
        self.walk = walk_model_state(run)


def rank_worker(rank: int, world: int, method: str, size: str, steps: int, batch: int) -> dict[str, Any]:
    """One rank's fit of ``method``: its peak RSS above the pre-fit baseline and its model-state bytes."""
    from helpers.launched import as_launched_rank

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed multi-page buffers leave the heap
    torch.set_num_threads(1)
    warm_up_kernels()
    as_launched_rank(rank, world)
    settings = TPSettings(config=SIZES[size], optimizer="adamw", lr=1e-3, steps=steps, batch=batch)
    module = TPLlamaModule(settings.config, settings.optimizer, settings.lr, settings.seed)
    walk = EndOfFitWalk(steps)
    trainer = pl.Trainer(
        strategy=STRATEGIES[method](settings), accelerator="cpu", devices=world, max_steps=steps, max_epochs=1,
        callbacks=[walk], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    baseline = reset_peak()
    trainer.fit(module, loader(settings))
    return {"peak": status_bytes("VmHWM") - baseline, "walk": walk.walk,
            "params": sum(p.numel() for p in TPLlamaModule(settings.config).model.parameters())}


def run_fresh(method: str, size: str, steps: int, batch: int, timeout_s: float) -> list[dict[str, Any]] | str:
    """``method`` on 4 ranks in a fresh interpreter: each rank's result, or the error that stopped it."""
    code = ("import json, sys; from zero_strategy.testing import run_ranks, RankFailed; from benchmarks import "
            "bench_tp as b; a = sys.argv[1:]\ntry: print(json.dumps(run_ranks(b.rank_worker, 4, a[0], a[1], "
            "int(a[2]), int(a[3]), timeout_s=float(a[4]), pg_timeout_s=float(a[4]))))\nexcept RankFailed as e: "
            "print(json.dumps(b.first_error(str(e))))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, method, size, str(steps), str(batch), str(timeout_s)],
                          capture_output=True, text=True, timeout=timeout_s + 60, cwd=REPO)  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        return first_error(done.stderr)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result if isinstance(result, list) else str(result)


def first_error(text: str) -> str:
    """The last ``SomethingError: ...`` line of a traceback (what went wrong), else the text's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return (errors or lines or ["no output"])[-1][:300]


def table(results: dict[str, list[dict[str, Any]] | str]) -> str:
    """The report: one row per method, the largest rank's figures, ratios against ``mps``."""
    head = ("| method | peak RSS above baseline MiB (max rank) | per rank | params MiB | grads MiB | "
            "optimizer MiB | params + optimizer MiB | vs mps (peak) | vs mps (params + optimizer) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    ref = results.get("mps")
    ref_peak = max(r["peak"] for r in ref) if isinstance(ref, list) else None
    ref_state = max(r["walk"][0] + r["walk"][2] for r in ref) if isinstance(ref, list) else None
    for method, ranks in results.items():
        if isinstance(ranks, str):
            lines.append(f"| {method} | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        peak = max(r["peak"] for r in ranks)
        params, grads, optim = (max(r["walk"][i] for r in ranks) for i in range(3))
        state = max(r["walk"][0] + r["walk"][2] for r in ranks)
        per_rank = "/".join(f"{r['peak'] / MiB:.0f}" for r in ranks)
        peak_ratio = f"{peak / ref_peak:.2f}x" if ref_peak else "n/a"
        state_ratio = f"{state / ref_state:.2f}x" if ref_state else "n/a"
        lines.append(f"| {method} | {peak / MiB:,.1f} | {per_rank} | {params / MiB:,.2f} | {grads / MiB:,.2f} | "
                     f"{optim / MiB:,.2f} | {state / MiB:,.2f} | {peak_ratio} | {state_ratio} |")  # fmt: skip
    failed = [f"{method}: n/a, {error}" for method, error in results.items() if isinstance(error, str)]
    return "\n".join(lines + (["", *failed] if failed else []))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--size", default="34m", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="samples per data-parallel rank per step")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per method")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    results: dict[str, list[dict[str, Any]] | str] = {}
    for method in methods:
        results[method] = run_fresh(method, args.size, args.steps, args.batch, args.timeout)
        print(f"{method}: done", flush=True)
    first = next((r for r in results.values() if isinstance(r, list)), None)
    params = f"{first[0]['params'] / 1e6:.1f} M parameters" if first else "no method ran"
    report = (f"Llama {args.size} ({params}), 2 data-parallel x 2 tensor-parallel CPU ranks, AdamW, "
              f"{args.steps} steps of {args.batch} samples per data-parallel rank\n\n{table(results)}")
    print(report, flush=True)
    return report


if __name__ == "__main__":
    main()
