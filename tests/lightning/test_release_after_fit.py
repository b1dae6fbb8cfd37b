"""A model built in ``configure_model`` (sharded) at stage 3 stays sharded after ``fit``: its parameters are on the
meta device, never gathered whole on a rank. ``trainer.save_checkpoint`` still writes the trained weights, and
``validate`` and a further ``fit`` on the same Trainer continue from them — each compared with DDP doing the same
(two ranks forked by run_ranks and taken by Lightning for ranks torchrun started, helpers/launched.py: every rank
runs the whole sequence, as under the popen launcher). See [Note: releasing a model built sharded] in
core/engine/release.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from helpers.lit import state_of, train_loader, trainer_kwargs, val_loader
from helpers.models import TiedLM, assert_state_close, lm_loss
from torch import nn

from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.testing import run_ranks


class BuiltInConfigureModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: TiedLM | None = None

    def configure_model(self) -> None:
        if self.net is None:  # runs again on every later validate/fit
            self.net = TiedLM(n_blocks=3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.net, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.net, batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _meta(model: nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


def fit_validate_refit(rank: int, world: int, out: str) -> dict[str, Any]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK), DDP then zero3:
    fit 3 steps, save, validate, fit on to step 6 on the same Trainer, save. Returns what each strategy left on this
    rank and the warnings raised on it."""
    as_launched_rank(rank, world)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("ddp", "zero3"):
            pl.seed_everything(0, verbose=False)
            model = BuiltInConfigureModel()
            trainer = pl.Trainer(strategy=name, default_root_dir=out, **trainer_kwargs(max_epochs=-1, max_steps=3))
            trainer.fit(model, train_loader())
            seen: dict[str, Any] = {"meta_after_fit": _meta(model)}
            if name == "ddp":
                seen["after_fit"] = state_of(model)
            trainer.save_checkpoint(f"{out}/{name}_fit.ckpt")
            seen["val"] = trainer.validate(model, val_loader(), verbose=False)[0]["val_loss"]
            seen["meta_after_validate"] = _meta(model)
            trainer.fit_loop.epoch_loop.max_steps = 6  # the same Trainer fits on from the weights it holds
            trainer.fit(model, train_loader())
            trainer.save_checkpoint(f"{out}/{name}_refit.ckpt")
            if name == "ddp":
                seen["after_refit"] = state_of(model)
            result[name] = seen
    result["warnings"] = [str(warning.message) for warning in caught]
    return result


@pytest.mark.timeout(120)  # measured: 1 s
def test_a_model_built_sharded_stays_sharded_and_trains_on_like_ddp(tmp_path: Path) -> None:
    results = run_ranks(fit_validate_refit, 2, str(tmp_path), timeout_s=90)
    # the warning says where the weights are
    assert any("parameters stay sharded" in message for result in results for message in result["warnings"])
    ddp = results[0]["ddp"]
    assert not ddp["meta_after_fit"]
    for rank, result in enumerate(results):
        zero = result["zero3"]
        assert zero["meta_after_fit"] and zero["meta_after_validate"], f"rank {rank}: gathered after all"
        assert zero["val"] == pytest.approx(ddp["val"], rel=1e-5), f"rank {rank}: validate after fit"
    fitted = torch.load(consolidate(tmp_path / "zero3_fit.ckpt", tmp_path / "fit.pt"), weights_only=True)
    assert_state_close(fitted, ddp["after_fit"], what="zero3 saved after fit vs ddp after fit")
    refitted = torch.load(consolidate(tmp_path / "zero3_refit.ckpt", tmp_path / "refit.pt"), weights_only=True)
    assert_state_close(refitted, ddp["after_refit"], what="zero3 second fit vs ddp second fit")
    assert not torch.allclose(ddp["after_refit"]["net.head.weight"], ddp["after_fit"]["net.head.weight"])
