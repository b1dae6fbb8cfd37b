"""Lightning's checkpoint hooks under ZeRO, against DDP (see [Note: restoring before setup] in
lightning/checkpoint_hooks.py and [Note: the state dict in Lightning's hooks] in lightning/hook_state_dict.py):
callbacks are restored before on_fit_start (ModelCheckpoint.best_model_path is known there, as under DDP);
on_save_checkpoint sees every key and a removed key is left out; on_load_checkpoint sees every key and renames take
effect (a checkpoint of `net.*` loads into a module whose attribute is `model`); a replaced value is an error, not
silently dropped. At every stage, stage 3 on both transports (one host's shared memory and point-to-point), on 1 and
2 processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.models import TiedLM, lm_loss
from lightning.pytorch.callbacks import ModelCheckpoint

from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.testing import run_ranks

FROZEN = "net.blocks.1."
STRATEGIES = {
    "ddp": lambda: "ddp",
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: ZeroStrategy(stage=3, collectives="auto"),
    "zero3_point_to_point": lambda: ZeroStrategy(stage=3, collectives="point_to_point"),
}


class Hooked(pl.LightningModule):
    """Drops its frozen block from checkpoints (a common way to keep a frozen backbone out of them)."""

    def __init__(self, attribute: str = "net") -> None:
        super().__init__()
        setattr(self, attribute, TiedLM(n_blocks=2))
        self.attribute = attribute
        self.best_at_fit_start: str | None = None
        self.strict_loading = False  # the dropped block is missing on resume, as with DDP
        for p in self.network.blocks[1].parameters():
            p.requires_grad_(False)

    @property
    def network(self) -> TiedLM:
        return getattr(self, self.attribute)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.network, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.network, batch[1]), sync_dist=True)

    def on_fit_start(self) -> None:
        self.best_at_fit_start = self.trainer.checkpoint_callback.best_model_path

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for key in [k for k in checkpoint["state_dict"] if k.startswith(FROZEN)]:
            del checkpoint["state_dict"][key]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.attribute != "net":  # a refactored module: the checkpoint's `net.*` keys now live under `model.*`
            state = checkpoint["state_dict"]
            checkpoint["state_dict"] = {f"{self.attribute}." + k.removeprefix("net."): v for k, v in state.items()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _trainer(strategy: str, root: Path, world: int, epochs: int) -> pl.Trainer:
    checkpoint = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=1, filename="best")
    return pl.Trainer(strategy=STRATEGIES[strategy](), accelerator="cpu", devices=world, max_epochs=epochs,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[checkpoint])


def fit_save_resume(rank: int, world: int, root: str) -> dict:
    as_launched_rank(rank, world)
    out: dict = {}
    for strategy in STRATEGIES:
        folder = Path(root) / strategy
        pl.seed_everything(0, verbose=False)
        first = Hooked()
        _trainer(strategy, folder, world, 1).fit(first, loader(16, 31), loader(8, 32))
        pl.seed_everything(1, verbose=False)  # another initialization: what the checkpoint does not hold stays so
        resumed = Hooked(attribute="model")
        trainer = _trainer(strategy, folder, world, 2)
        trainer.fit(resumed, loader(16, 31), loader(8, 32), ckpt_path=str(folder / "best.ckpt"))
        with getattr(trainer.strategy, "gathered_parameters", lambda: torch.no_grad())():
            final = {k: v.detach().clone() for k, v in resumed.model.state_dict().items()}
        out[strategy] = {"best_at_fit_start": resumed.best_at_fit_start, "final": final}
    try:  # a hook that puts a value of its own is refused, not silently ignored
        class Replaces(Hooked):
            def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
                checkpoint["state_dict"]["net.head.weight"] = torch.zeros(1)

        _trainer("zero3", Path(root) / "replaces", world, 1).fit(Replaces(), loader(16, 31), loader(8, 32))
        out["replaces"] = "no error"
    except Exception as error:
        out["replaces"] = str(error)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2], ids=["1_process", "2_processes"])
def test_checkpoint_hooks_edit_keys_and_callbacks_restore_before_fit_start(tmp_path: Path, world: int) -> None:
    results = run_ranks(fit_save_resume, world, str(tmp_path), timeout_s=400)
    for rank, result in enumerate(results):
        ddp = result["ddp"]
        assert ddp["best_at_fit_start"].endswith("best.ckpt"), ddp["best_at_fit_start"]  # what DDP restores first
        for name in [n for n in STRATEGIES if n != "ddp"]:
            zero = result[name]
            assert zero["best_at_fit_start"] == ddp["best_at_fit_start"].replace("/ddp/", f"/{name}/"), (name, rank)
            assert zero["final"].keys() == ddp["final"].keys(), name
            for key, value in ddp["final"].items():  # the renamed keys loaded, the dropped block kept its new init
                torch.testing.assert_close(zero["final"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        assert "net.head.weight" in result["replaces"] and "only keys can be edited" in result["replaces"]
    for name in [n for n in STRATEGIES if n != "ddp"]:
        saved = torch.load(consolidate(tmp_path / name / "best.ckpt", tmp_path / f"{name}.pt"), weights_only=True)
        assert saved and not [k for k in saved if k.startswith(FROZEN)], (name, sorted(saved))
