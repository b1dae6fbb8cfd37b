"""What one run of the main job measured, and the table that compares the runs of a sweep.

``python examples/train.py -m strategy=zero1_spawn,zero2_spawn,zero3_spawn`` runs the jobs one after another; each
appends its row to ``summary.md`` (and ``summary.jsonl``) in the sweep directory, so the file compares them:
per-rank model-state memory (the strategy's own storage walk, taken at the end of training, before teardown),
median step time and the final validation loss.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

MEMORY_FILE = "memory_rank0.json"


class MeasureRun(Callback):
    """Rank 0 writes its memory report and step times into the run directory (works with spawn launchers,
    whose workers cannot return objects to the main process)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._last: float | None = None
        self.step_seconds: list[float] = []

    # A batch is timed from its start to the next one's (the epoch's last to the epoch's end), not to
    # on_train_batch_end: a callback overriding that hook makes stages 2/3 keep an accumulation window's gradients
    # (ZeroConfig.keep_window_gradients), and this run measures ZeRO's memory.
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.step_seconds.append(now - self._last)
        self._last = now

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last is not None:
            self.step_seconds.append(time.perf_counter() - self._last)
        self._last = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        report = trainer.strategy.memory_report() if hasattr(trainer.strategy, "memory_report") else None
        if trainer.is_global_zero:
            record = {
                "parameters": report.parameters if report else None,
                "gradients": report.gradients if report else None,
                "optimizer_state": report.optimizer_state if report else None,
                "median_step_ms": 1000 * statistics.median(self.step_seconds[1:] or self.step_seconds),
            }
            Path(self.run_dir, MEMORY_FILE).write_text(json.dumps(record))


def append_summary(sweep_dir: Path, run_dir: Path, label: str, val_loss: float, val_ppl: float) -> Path:
    """Add this run's row to the sweep's ``summary.md`` (header written by the first run)."""
    measured = json.loads((run_dir / MEMORY_FILE).read_text())
    row = {"run": label, "val_loss": val_loss, "val_ppl": val_ppl, **measured}
    with open(sweep_dir / "summary.jsonl", "a") as handle:
        handle.write(json.dumps(row) + "\n")
    table = sweep_dir / "summary.md"
    if not table.exists():
        table.write_text(
            "| run | params MiB/rank | grads MiB/rank | optimizer MiB/rank | median step ms | val loss | val ppl |\n"
            "|---|---|---|---|---|---|---|\n"
        )

    def mib(value: int | None) -> str:
        return "n/a" if value is None else f"{value / 2**20:.2f}"

    with open(table, "a") as handle:
        handle.write(
            f"| {label} | {mib(row['parameters'])} | {mib(row['gradients'])} | {mib(row['optimizer_state'])} | "
            f"{row['median_step_ms']:.1f} | {val_loss:.4f} | {val_ppl:.3f} |\n"
        )
    return table
