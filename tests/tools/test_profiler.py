"""ZeroStrategy(profile=True): per-step compute vs. communication, bytes per kind, logged and summarised. The 2-rank
fits run on ranks that run_ranks forks and Lightning takes for ranks torchrun started (the launcher is not what is
tested here), one launch per fit."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy
from zero_strategy.lightning.profiler import KINDS, CommunicationProfiler, StepRecord
from zero_strategy.testing import run_ranks

# Delays injected into every step, each into one part of the profiler's split: the compute (inside training_step),
# every wait for a peer in communication (the three reduce-scatters, and on the shared-memory path also its
# all-reduce and barriers: the test counts them), and the optimizer step. SLACK_S is what the real work of a step
# (a few milliseconds here) may add on a busy machine; each delay is larger, so a part booked to the wrong place (or
# not subtracted) moves a figure out of its window.
COMPUTE_DELAY_S = 0.3
WAIT_DELAY_S = 0.1
OPTIMIZER_DELAY_S = 0.3
SLACK_S = 0.25
REDUCE_SCATTERS_PER_STEP = 3  # one per block (stage 3, each block a unit)


class SlowCommunication(Callback):
    """Makes every wait for peers of a rank ``WAIT_DELAY_S`` longer, as a slow network or a late peer would keep it
    waiting: the wait of a point-to-point reduce-scatter's handle, and every wait for the peers' counters on the
    shared-memory path (reductions, all-reduces, barriers). ``per_batch`` holds the seconds this rank slept this way
    in each training batch: the test's own account of the communication delay.

    The transports' methods are replaced for good in ``setup``, in the rank's own process: for one fit per process,
    such as a rank that run_ranks forks for one fit and that exits after it (the test's process keeps the originals;
    a second fit in the same process would wrap them again)."""

    def __init__(self) -> None:
        self.slept_s = 0.0
        self._slept_at_batch_start = 0.0
        self.per_batch: list[float] = []

    def _sleep(self) -> None:
        time.sleep(WAIT_DELAY_S)
        self.slept_s += WAIT_DELAY_S

    def setup(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from zero_strategy.core.comm.point_to_point import PointToPointComm
        from zero_strategy.core.comm.shm_exchange import SharedExchange
        from zero_strategy.core.comm.work import Work

        wait_for_peers = SharedExchange.wait_for_peers
        callback = self

        def slow_wait_for_peers(self: SharedExchange, sequence: int, label: str) -> None:
            callback._sleep()
            wait_for_peers(self, sequence, label)

        SharedExchange.wait_for_peers = slow_wait_for_peers

        original = PointToPointComm.reduce_scatter

        def slow_reduce_scatter(self: PointToPointComm, *args, **kwargs) -> Work:
            work = original(self, *args, **kwargs)

            def slow_wait():
                with self.log.blocking("reduce_scatter"):  # the transport's own wait, as a slow network makes it
                    callback._sleep()
                return work.wait()

            return Work(slow_wait)

        PointToPointComm.reduce_scatter = slow_reduce_scatter

    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        # and every optimizer step OPTIMIZER_DELAY_S longer (a step post-hook runs inside the timed step)
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(lambda *args: time.sleep(OPTIMIZER_DELAY_S))

    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        self._slept_at_batch_start = self.slept_s

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        self.per_batch.append(self.slept_s - self._slept_at_batch_start)


class Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        time.sleep(COMPUTE_DELAY_S)  # compute, as far as the profiler can tell: neither communication nor step
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def profiled_fit(rank: int, world: int, collectives: str, log_dir: Path) -> list[float]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK), a profiled stage-3
    fit of 4 steps logged to ``log_dir``; the seconds this rank's communication waits were delayed, per batch."""
    as_launched_rank(rank, world)
    slow_communication = SlowCommunication()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, profile=True, collectives=collectives),
        accelerator="cpu", devices=world, max_steps=4, log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=CSVLogger(log_dir, name="p"),
        callbacks=[slow_communication],
    )
    trainer.fit(Blocks(), DataLoader(TensorDataset(torch.randn(64, 64)), batch_size=8))
    return slow_communication.per_batch


@pytest.mark.timeout(120)  # 4 steps of at least 0.9 s of injected delays: 5.7 s measured with both cores busy
@pytest.mark.parametrize("collectives", ["auto", "point_to_point"])
def test_profile_logs_bytes_and_time_per_collective(tmp_path: Path, collectives: str) -> None:
    waits = run_ranks(profiled_fit, 2, collectives, tmp_path, timeout_s=100)[0]  # rank 0's, as the log is
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    gathered = [float(r["comm/all_gather_bytes"]) for r in rows if r.get("comm/all_gather_bytes")]
    scattered = [float(r["comm/reduce_scatter_bytes"]) for r in rows if r.get("comm/reduce_scatter_bytes")]
    psi_bytes = 3 * (64 * 64 + 64) * 4
    assert len(gathered) == 4
    if collectives == "auto":  # one host's CPU: the parameters are read in place, nothing is gathered
        assert gathered == [0.0] * 4, gathered
    else:  # stage 3, per step: gathered for forward and again for backward (≤ 2Ψ: the root stays whole)
        assert all(psi_bytes <= g <= 2 * psi_bytes + 64 for g in gathered), gathered
    assert all(psi_bytes <= s <= psi_bytes + 64 for s in scattered), scattered
    # Each part of the split against the delays injected into it (the figures come from the profiler, the windows
    # from the delays): the reduce-scatters' waits, all communication waits (as many as rank 0 counted), the
    # optimizer step and the compute each hold their delay and at most SLACK_S more, and the step holds all of them.
    column = {name: [float(r[f"comm/{name}"]) for r in rows if r.get(f"comm/{name}")] for name in
              ("step_s", "compute_s", "optimizer_s", "exposed_s", "reduce_scatter_blocked_s", "above_compute_share")}
    assert len(waits) == 4 and all(len(values) == 4 for values in column.values()), (waits, column)
    for i, waited in enumerate(waits):
        assert waited >= REDUCE_SCATTERS_PER_STEP * WAIT_DELAY_S - 1e-9, waits  # the reduce-scatters were delayed
        injected = {"compute_s": COMPUTE_DELAY_S, "optimizer_s": OPTIMIZER_DELAY_S, "exposed_s": waited,
                    "reduce_scatter_blocked_s": REDUCE_SCATTERS_PER_STEP * WAIT_DELAY_S,
                    "step_s": COMPUTE_DELAY_S + OPTIMIZER_DELAY_S + waited}
        for name, delay in injected.items():
            assert delay <= column[name][i] <= delay + SLACK_S, (i, name, delay, column[name])
        # the share of the step that is not compute, (optimizer + communication) / step, within the windows above
        whole = injected["step_s"] + SLACK_S
        low, high = (OPTIMIZER_DELAY_S + waited) / whole, 1 - COMPUTE_DELAY_S / whole
        assert low <= column["above_compute_share"][i] <= high, (i, low, high, column["above_compute_share"])


def test_summary_splits_the_step() -> None:
    profiler = CommunicationProfiler()
    blocked = dict.fromkeys(KINDS, 0.0) | {"reduce_scatter": 0.002}
    sent = dict.fromkeys(KINDS, 0)
    profiler.records = [StepRecord(0.02, blocked, sent, 0.004)] * 3  # the first is skipped as warm-up
    summary = profiler.summary()
    assert "forward/backward and other compute 14.0 ms, optimizer step 4.0 ms, communication not hidden 2.0 ms" in (
        summary
    ) and "30.0% of the step" in summary, summary
