"""A LightningModule built three ways (eagerly in __init__, in configure_model, under Trainer.init_module), and the
run of tests/lightning/test_save_matrix.py: fit (saving during fit), then save after fit, after validate, after
test — each save's outcome ("ok" or the error's message) for the test to check (see [Note: saving after fit] in
zero_strategy/lightning/sharded_model.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from helpers.lit import loader
from helpers.models import TiedLM, lm_loss

CONSTRUCTIONS = ("eager", "configure_model", "init_module")
CALL_SITES = ("during_fit", "after_fit", "after_validate", "after_test")


class Built(pl.LightningModule):
    def __init__(self, construction: str) -> None:
        super().__init__()
        self.construction = construction
        self.net: TiedLM | None = TiedLM(n_blocks=2) if construction != "configure_model" else None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = TiedLM(n_blocks=2)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        assert self.net is not None
        return lm_loss(self.net, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        assert self.net is not None
        self.log("val_loss", lm_loss(self.net, batch[1]), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SaveDuringFit(pl.Callback):
    """At the end of training, on every rank: the trained weights (state_dict() gathers at stage 3), then a save."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trained = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(trained, self.out / "trained.pt")
        trainer.save_checkpoint(self.out / "during_fit.ckpt")


def outcome(save: Any) -> str:
    try:
        save()
    except Exception as error:  # what the user would see
        return f"{type(error).__name__}: {error}"
    return "ok"


def run(strategy: str, construction: str, out: Path) -> dict[str, str]:
    """Fit, validate and test one module on one Trainer, saving after each; the outcome of each save."""
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[SaveDuringFit(out)])
    if construction == "init_module":
        try:
            with trainer.init_module(empty_init=True):
                model = Built(construction)
        except RuntimeError as error:  # refused before any training starts (spawn launchers)
            return {site: f"{type(error).__name__}: {error}" for site in CALL_SITES}
    else:
        model = Built(construction)
    trainer.fit(model, loader(16, 11))
    outcomes = {"during_fit": "ok" if (out / "during_fit.ckpt").is_dir() else "missing"}
    outcomes["after_fit"] = outcome(lambda: trainer.save_checkpoint(out / "after_fit.ckpt"))
    trainer.validate(model, loader(8, 12), verbose=False)
    outcomes["after_validate"] = outcome(lambda: trainer.save_checkpoint(out / "after_validate.ckpt"))
    trainer.test(model, loader(8, 13), verbose=False)
    outcomes["after_test"] = outcome(lambda: trainer.save_checkpoint(out / "after_test.ckpt"))
    return outcomes
