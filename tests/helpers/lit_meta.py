"""A LightningModule that builds its network in ``configure_model`` (meta-device construction under ZeRO) and may
load pretrained weights there, for tests/lightning/test_sharded_construction_trainer.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

import zero_strategy
from helpers.lit import LR
from helpers.meta_models import TransformerLM
from helpers.models import lm_loss


class ConfiguredLM(pl.LightningModule):
    def __init__(self, out_dir: str, pretrained: str | None = None, key_map: Any = None) -> None:
        super().__init__()
        self.net: TransformerLM | None = None
        self.out_dir, self.pretrained, self.key_map = out_dir, pretrained, key_map

    def configure_model(self) -> None:
        if self.net is not None:  # configure_model runs again on a later fit/test
            return
        self.net = TransformerLM()
        if self.pretrained is not None:
            zero_strategy.load_pretrained(self.net, self.pretrained, key_map=self.key_map)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        _, tokens = batch
        assert self.net is not None
        return lm_loss(self.net, tokens)

    def on_train_end(self) -> None:
        # Built sharded at stage 3, the parameters stay sharded (meta) after fit, and a spawned rank has no process
        # group left by on_fit_end: the ranks save the trained state together now, consolidated by the test.
        if getattr(self.trainer.strategy, "config", None) is not None and self.trainer.strategy.config.stage == 3:
            self.trainer.save_checkpoint(Path(self.out_dir) / "after_fit.ckpt")

    def on_fit_end(self) -> None:
        # Runs after the strategy's teardown. Spawned ranks' weights do not come back to the main process (its
        # module never ran configure_model), so each rank writes its own.
        if any(p.is_meta for p in self.parameters()):
            return
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        torch.save(state, Path(self.out_dir) / f"state_rank{self.global_rank}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class LoadsInConfigureModel(ConfiguredLM):
    """The eager reference for ``ZeroStrategy(pretrained=...)``: the same file loaded into the whole module."""

    def __init__(self, out_dir: str, whole_module_file: str) -> None:
        super().__init__(out_dir)
        self.whole_module_file = whole_module_file

    def configure_model(self) -> None:
        if self.net is None:
            super().configure_model()
            zero_strategy.load_pretrained(self, self.whole_module_file)
