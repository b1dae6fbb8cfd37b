"""ZeroStrategy.from_deepspeed_config through a real 2-rank Trainer: settings arrive, batch mismatches stop early."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy


class Reporter(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            strategy = self.trainer.strategy
            Path(self.out).write_text(json.dumps({
                "stage": strategy.config.stage,
                "precision": self.trainer.precision_plugin.precision,
                "clip": self.trainer.gradient_clip_val,
                "window": self.trainer.precision_plugin.scaler.config.loss_scale_window,
            }))


def fit(tmp_path: Path, ds: dict, batch_size: int = 4) -> dict:
    out = tmp_path / "out.json"
    strategy = ZeroStrategy.from_deepspeed_config(ds, start_method="spawn")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=batch_size)
    trainer.fit(Reporter(str(out)), data)
    return json.loads(out.read_text())


DS = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 0.5,
    "fp16": {"enabled": True, "loss_scale_window": 77},
    "zero_optimization": {"stage": 2},
}


@pytest.mark.timeout(120)
def test_deepspeed_config_reaches_strategy_precision_and_trainer(tmp_path: Path) -> None:
    got = fit(tmp_path, DS)
    assert got == {"stage": 2, "precision": "16-mixed", "clip": 0.5, "window": 77}


@pytest.mark.timeout(120)
def test_batch_mismatch_with_the_dataloader_fails_with_all_numbers(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="train_batch_size") as info:
        fit(tmp_path, DS, batch_size=3)
    message = str(info.value)
    assert "8" in message and "3" in message
