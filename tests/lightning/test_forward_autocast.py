"""The Trainer's forward runs under the precision's autocast: bf16 autocast on the engine's device with
``bf16-mixed``, none with ``32-true`` — in every training step, before and after the first optimizer step, and again
in a second fit of the same Trainer (a new engine). ZeroPrecision learns the device once per engine, not per forward:
this holds that the context is still the precision's. 2 ranks of a ``run_ranks`` launch, each as torchrun starts it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

STEPS = 3


class RecordsAutocast(pl.LightningModule):
    """Records, in each training step, whether CPU autocast is on and to which dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.seen: list[tuple[bool, torch.dtype]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).squeeze(-1).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def fit_twice(rank: int, world: int, precision: str) -> list[Any]:
    as_launched_rank(rank, world)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, generator=g))
    module = RecordsAutocast()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=world, precision=precision, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(module, DataLoader(data, batch_size=4))  # a second setup: a new engine
    return [(enabled, str(dtype)) for enabled, dtype in module.seen]


@pytest.mark.timeout(180)  # two fits of 3 steps on 2 ranks per precision: about 1 s each here
@pytest.mark.parametrize(("precision", "autocast"), [("bf16-mixed", True), ("32-true", False)])
def test_every_training_step_runs_under_the_precisions_autocast(precision: str, autocast: bool) -> None:
    for rank, seen in enumerate(run_ranks(fit_twice, 2, precision, timeout_s=150)):
        assert len(seen) == 2 * STEPS, f"rank {rank}: {len(seen)} training steps recorded"
        for step, (enabled, dtype) in enumerate(seen):
            assert enabled is autocast, f"rank {rank}, step {step}: autocast {'off' if autocast else 'on'}"
            if autocast:
                assert dtype == str(torch.bfloat16), f"rank {rank}, step {step}: autocast to {dtype}"
