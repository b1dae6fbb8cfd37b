"""A small LightningModule and a spawn-launched ``Trainer.fit`` helper for the Lightning-level checkpoint tests.

The module is importable by name (this folder is on ``sys.path`` under pytest and in the processes Lightning's
spawn launcher starts), so the launcher can pickle it.

[Note: comparable layouts]
Every layout sees the same *global* batch per optimizer step: 64 samples, global batch 16, split evenly over
``devices`` ranks (16 / devices per rank), so an epoch is 4 steps whatever the world size and Lightning's loop
counters mean the same thing after resharding. The DistributedSampler's shuffle is a permutation of the whole
dataset that does not depend on the world size, and rank r takes every world-th index, so the union of the ranks'
step-k batches is the same 16 samples for 1, 2 or 4 ranks. BatchNorm is switched off where layouts are compared:
its batch statistics are per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy

SAMPLES = 64
GLOBAL_BATCH = 16
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
WIDTH = 8


class LitNet(pl.LightningModule):
    """Input layer → blocks (Linear, Dropout, Tanh) → optional BatchNorm → a projection tied to the input layer's
    weight → a scalar head. AdamW with a StepLR stepped every epoch (or every step with
    ``scheduler_interval="step"``); its state is part of the trainer state."""

    def __init__(
        self, dropout: float = 0.0, batch_norm: bool = True, lr: float = 0.01, scheduler_interval: str = "epoch"
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(dropout), nn.Tanh()) for _ in range(3)
        )
        self.norm: nn.Module = nn.BatchNorm1d(WIDTH) if batch_norm else nn.Identity()
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.proj.weight = self.inp.weight  # tied: one parameter under two state_dict keys
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(torch.tanh(self.proj(self.norm(h))))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        interval = self.hparams.scheduler_interval
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3 if interval == "step" else 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": interval}}


def make_loader(devices: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    y = torch.randn(SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // devices, shuffle=True)


class StartStepRecorder(Callback):
    """Rank 0 writes the global step the fit starts at into a file (the spawn launcher does not bring a
    callback's attributes back to the main process)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(str(trainer.global_step))


def every_n_steps(dirpath: Path, n: int = 4) -> ModelCheckpoint:
    """Keeps every checkpoint, named ``step=<k>.ckpt``."""
    return ModelCheckpoint(
        dirpath=dirpath, filename="step={step}", auto_insert_metric_name=False, every_n_train_steps=n, save_top_k=-1
    )


def top_k(dirpath: Path, k: int = 2, n: int = 2) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=dirpath,
        filename="loss-step={step}",
        auto_insert_metric_name=False,
        every_n_train_steps=n,
        save_top_k=k,
        monitor="train_loss",
        mode="min",
        save_last=True,
    )


def fit(
    root: Path,
    *,
    stage: int = 3,
    devices: int = 2,
    max_steps: int = 12,
    ckpt_path: str | Path | None = None,
    dropout: float = 0.0,
    batch_norm: bool = True,
    scheduler_interval: str = "epoch",
    callbacks: Sequence[Callback] = (),
) -> dict[str, Tensor]:
    """Train a fresh LitNet (same initial weights every time) with a spawn-launched ZeRO Trainer; return the
    trained module's state_dict as the main process receives it."""
    pl.seed_everything(0, verbose=False)
    model = LitNet(dropout=dropout, batch_norm=batch_norm, scheduler_interval=scheduler_interval)
    strategy = ZeroStrategy(stage=stage, start_method="spawn", process_group_timeout_s=60.0)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=list(callbacks),
        default_root_dir=root,
    )
    trainer.fit(model, make_loader(devices), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
