"""A small LightningModule, its data and the callbacks of the Lightning-level checkpoint tests.

[Note: comparable layouts]
Every layout sees the same *global* batch per optimizer step: 64 samples, global batch 16, split evenly over
``devices`` ranks (16 / devices per rank), so an epoch is 4 steps whatever the world size and Lightning's loop
counters mean the same thing after resharding. The DistributedSampler's shuffle is a permutation of the whole
dataset that does not depend on the world size, and rank r takes every world-th index, so the union of the ranks'
step-k batches is the same 16 samples for 1, 2 or 4 ranks. BatchNorm is switched off where layouts are compared:
its batch statistics are per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

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
    """Rank 0 writes the global step the fit starts at into a file (the callback object stays in the rank's
    process): a resumed fit must start at its checkpoint's step, or it did not resume at all."""

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

