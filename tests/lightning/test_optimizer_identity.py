"""The optimizer and the LR scheduler stay what the user built: same class, picklable, deep-copyable, and a
scheduler state_dict without extra keys — during a zero2 fp16 fit (where a skipped step holds the schedule back)
and after it. The fit runs on 2 ranks of a ``run_ranks`` launch, each fitting as a rank torchrun started."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from torch import Tensor, nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

LR, GAMMA, STEPS, POISONED_STEP = 1e-2, 0.9, 4, 1


def _facts(optimizer: torch.optim.Optimizer, scheduler: StepLR) -> dict[str, Any]:
    """What user code and libraries may do with the objects Lightning hands out."""
    reference = StepLR(torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=LR), step_size=1, gamma=GAMMA)
    reference.step()
    return {
        "optimizer_type": type(optimizer) is torch.optim.AdamW,
        "scheduler_type": type(scheduler) is StepLR,
        "pickled_optimizer": type(pickle.loads(pickle.dumps(optimizer))) is torch.optim.AdamW,
        "copied_optimizer": type(copy.deepcopy(optimizer)) is torch.optim.AdamW,
        "pickled_scheduler": type(pickle.loads(pickle.dumps(scheduler))) is StepLR,
        "copied_scheduler": type(copy.deepcopy(scheduler)) is StepLR,
        "scheduler_keys": sorted(scheduler.state_dict()),
        "reference_keys": sorted(reference.state_dict()),
    }


class Inspect(pl.Callback):
    """The facts in the middle of the fit (right after the skipped step) and after teardown."""

    def __init__(self) -> None:
        self.during: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == POISONED_STEP + 1:
            wrapper = pl_module.optimizers()
            self.during = _facts(trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler)
            self.during["wrapper_isinstance"] = isinstance(wrapper, torch.optim.AdamW)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
        after = _facts(optimizer, scheduler)
        after["nothing_left"] = "zero_grad" not in vars(optimizer) and "lr_scheduler_step" not in vars(pl_module)
        after["lr"] = optimizer.param_groups[0]["lr"]
        after["skipped"] = trainer.precision_plugin.skipped_steps  # type: ignore[attr-defined]
        self.after = after


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float().squeeze(-1), y)
        if self.global_step == POISONED_STEP and self.global_rank == 1:
            loss = loss * float("inf")  # an fp16 overflow on one rank: the step is skipped on both
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        scheduler = StepLR(optimizer, step_size=1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit_and_inspect(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK): the facts during
    and after a zero2 fp16 fit whose second step overflows on rank 1."""
    as_launched_rank(rank, world)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, generator=g))
    inspect = Inspect()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=world, precision="16-mixed", max_steps=STEPS,
        callbacks=[inspect], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8))
    return {"during": inspect.during, "after": inspect.after}


@pytest.mark.timeout(120)  # one fit on 2 ranks: 0.2 s measured
def test_optimizer_and_scheduler_keep_their_class_during_and_after_a_zero2_fit() -> None:
    for rank, facts in enumerate(run_ranks(fit_and_inspect, 2, timeout_s=100)):
        for when in ("during", "after"):
            got = facts[when]
            assert got["scheduler_keys"] == got["reference_keys"], (rank, when)  # nothing of ours in its checkpoints
            for key, value in got.items():
                if isinstance(value, bool):
                    assert value, f"rank {rank}, {when} the fit: {key}"
        assert facts["during"]["wrapper_isinstance"]
        assert facts["after"]["skipped"] == 1
        # the skipped step did not advance the step-interval schedule
        assert facts["after"]["lr"] == pytest.approx(LR * GAMMA ** (STEPS - 1))
