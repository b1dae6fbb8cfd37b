"""ZeroStrategy(profile=True): per-step compute vs. communication, bytes per kind, logged and summarised."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy
from zero_strategy.lightning.profiler import KINDS, CommunicationProfiler, StepRecord

REDUCTION_DELAY_S = 0.1
OPTIMIZER_DELAY_S = 0.05


class SlowReductions(Callback):
    """Makes every reduce-scatter of a spawned rank take ``REDUCTION_DELAY_S`` longer to complete: the wait of the
    exchange's handle sleeps first, as a slow network or a late peer would keep it waiting (point-to-point, and
    through shared memory, where the wait for the peers' counters sleeps first)."""

    def setup(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from zero_strategy.core.comm.point_to_point import PointToPointComm
        from zero_strategy.core.comm.shm_exchange import SharedExchange
        from zero_strategy.core.comm.work import Work

        wait_for_peers = SharedExchange.wait_for_peers

        def slow_wait_for_peers(self: SharedExchange, sequence: int, label: str) -> None:
            time.sleep(REDUCTION_DELAY_S)
            wait_for_peers(self, sequence, label)

        SharedExchange.wait_for_peers = slow_wait_for_peers  # stage 3 with shared shards: reductions only

        original = PointToPointComm.reduce_scatter

        def slow_reduce_scatter(self: PointToPointComm, *args, **kwargs) -> Work:
            work = original(self, *args, **kwargs)

            def slow_wait():
                with self.log.blocking("reduce_scatter"):  # the transport's own wait, as a slow network makes it
                    time.sleep(REDUCTION_DELAY_S)
                return work.wait()

            return Work(slow_wait)

        PointToPointComm.reduce_scatter = slow_reduce_scatter

    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        # and every optimizer step OPTIMIZER_DELAY_S longer (a step post-hook runs inside the timed step)
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(lambda *args: time.sleep(OPTIMIZER_DELAY_S))


class Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(120)
def test_profile_logs_bytes_and_time_per_collective(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, start_method="spawn", profile=True),
        accelerator="cpu", devices=2, max_steps=4, log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=CSVLogger(tmp_path, name="p"),
        callbacks=[SlowReductions()],
    )
    trainer.fit(Blocks(), DataLoader(TensorDataset(torch.randn(64, 64)), batch_size=8))
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    gathered = [float(r["comm/all_gather_bytes"]) for r in rows if r.get("comm/all_gather_bytes")]
    scattered = [float(r["comm/reduce_scatter_bytes"]) for r in rows if r.get("comm/reduce_scatter_bytes")]
    psi_bytes = 3 * (64 * 64 + 64) * 4
    assert len(gathered) == 4
    # stage 3, per step: gathered for forward and again for backward (≤ 2Ψ: the root stays whole), scattered Ψ
    assert all(psi_bytes <= g <= 2 * psi_bytes + 64 for g in gathered), gathered
    assert all(psi_bytes <= s <= psi_bytes + 64 for s in scattered), scattered
    steps = [float(r["comm/step_s"]) for r in rows if r.get("comm/step_s")]
    compute = [float(r["comm/compute_s"]) for r in rows if r.get("comm/compute_s")]
    assert all(0 <= c <= s for c, s in zip(compute, steps, strict=True))
    # Each step reduces the three blocks once, each wait delayed by REDUCTION_DELAY_S: the
    # reported blocked time must contain the injected delay, and not much more (the real exchange of 16 KiB takes
    # well under a millisecond; the slack allows for a busy machine).
    blocked = [float(r["comm/reduce_scatter_blocked_s"]) for r in rows if r.get("comm/reduce_scatter_blocked_s")]
    assert len(blocked) == 4
    injected = 3 * REDUCTION_DELAY_S
    assert all(injected <= b <= injected + 0.25 for b in blocked), blocked
    exposed = [float(r["comm/exposed_s"]) for r in rows if r.get("comm/exposed_s")]
    assert all(e >= b for e, b in zip(exposed, blocked, strict=True)) and all(s >= injected for s in steps)
    # the optimizer step is its own part of the split: it holds the injected delay, and the three parts add up
    stepping = [float(r["comm/optimizer_s"]) for r in rows if r.get("comm/optimizer_s")]
    assert len(stepping) == 4 and all(OPTIMIZER_DELAY_S <= o <= OPTIMIZER_DELAY_S + 0.25 for o in stepping), stepping
    for c, o, e, s in zip(compute, stepping, exposed, steps, strict=True):
        assert c + o + e == pytest.approx(s, abs=1e-6), (c, o, e, s)
    shares = [float(r["comm/above_compute_share"]) for r in rows if r.get("comm/above_compute_share")]
    for share, o, e, s in zip(shares, stepping, exposed, steps, strict=True):
        assert share == pytest.approx((o + e) / s, rel=1e-4)


def test_summary_splits_the_step() -> None:
    profiler = CommunicationProfiler()
    blocked = dict.fromkeys(KINDS, 0.0) | {"reduce_scatter": 0.002}
    sent = dict.fromkeys(KINDS, 0)
    profiler.records = [StepRecord(0.02, blocked, sent, 0.004)] * 3  # the first is skipped as warm-up
    summary = profiler.summary()
    assert "forward/backward and other compute 14.0 ms, optimizer step 4.0 ms, communication not hidden 2.0 ms" in (
        summary
    ) and "30.0% of the step" in summary, summary
