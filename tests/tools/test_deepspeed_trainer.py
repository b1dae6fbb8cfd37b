"""ZeroStrategy.from_deepspeed_config through a real 2-rank Trainer: settings arrive, batch mismatches stop early.

Both fits run in one ``run_ranks`` launch, on 2 ranks that Lightning takes for ranks torchrun started."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks


class Reporter(pl.LightningModule):
    """Records, at the end of training, the settings the strategy, precision plugin and Trainer ended with."""

    def __init__(self) -> None:
        super().__init__()
        self.settings: dict[str, Any] = {}
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_train_end(self) -> None:
        self.settings = {
            "stage": self.trainer.strategy.config.stage,
            "precision": self.trainer.precision_plugin.precision,
            "clip": self.trainer.gradient_clip_val,
            "window": self.trainer.precision_plugin.scaler.config.loss_scale_window,
        }


def fit(ds: dict, world: int, batch_size: int = 4) -> dict[str, Any]:
    strategy = ZeroStrategy.from_deepspeed_config(ds)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=batch_size)
    module = Reporter()
    trainer.fit(module, data)
    return module.settings


DS = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 0.5,
    "fp16": {"enabled": True, "loss_scale_window": 77},
    "zero_optimization": {"stage": 2},
}


def fit_both(rank: int, world: int) -> dict[str, Any]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK): the settings
    after a fit with DS, then the error a fit with a dataloader batch that contradicts DS's raises."""
    as_launched_rank(rank, world)
    out: dict[str, Any] = {"settings": fit(DS, world)}
    try:
        fit(DS, world, batch_size=3)
        out["mismatch"] = "no error"
    except Exception as error:  # any exception is recorded; the test checks it is the named one
        out["mismatch"] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(fit_both, 2, timeout_s=100)


@pytest.mark.timeout(120)  # both fits on 2 ranks, once for the two tests: 0.3 s measured
def test_deepspeed_config_reaches_strategy_precision_and_trainer(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        assert run["settings"] == {"stage": 2, "precision": "16-mixed", "clip": 0.5, "window": 77}, f"rank {rank}"


@pytest.mark.timeout(120)  # both fits on 2 ranks, once for the two tests: 0.3 s measured
def test_batch_mismatch_with_the_dataloader_fails_with_all_numbers(runs: list[dict[str, Any]]) -> None:
    """DataLoader batch 3 on 2 ranks, no accumulation, against train_batch_size 8 and micro batch 4: the error
    names each of the four numbers with where it came from, the product, and the conflicting micro batch."""
    for rank, run in enumerate(runs):
        message = run["mismatch"]
        assert message.startswith("DeepSpeedConfigError: "), f"rank {rank}: not the batch error: {message}"
        for line in (
            "train_batch_size = 8  (from <dict> \"train_batch_size\")",
            "train_micro_batch_size_per_gpu = 3  (from the DataLoader's batch_size)",
            "gradient_accumulation_steps = 1  (from Trainer(accumulate_grad_batches))",
            "world_size = 2  (from the Trainer: devices * num_nodes)",
            "3 * 1 * 2 = 6, not 8",
            '<dict> "train_micro_batch_size_per_gpu" is 4, not 3',
        ):
            assert line in message, f"rank {rank}: the error does not say {line!r}:\n{message}"
