"""LightningModules that build their network in ``configure_model`` (meta-device construction under ZeRO): one that
may load pretrained weights there, one seeded there that also builds metrics there, for
tests/lightning/test_sharded_construction_trainer.py."""

from __future__ import annotations

import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torchmetrics
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn

import zero_strategy
from helpers.lit import LR
from helpers.meta_models import TransformerLM
from helpers.models import VOCAB, lm_loss
from zero_strategy import ZeroStrategy


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


class SeededWithMetrics(pl.LightningModule):
    """Builds everything in ``configure_model``, as Lightning's ZeRO-3 guide says: seeded there (``seed_everything``
    seeds torch, Python and numpy; Lightning's demo seeds with ``torch.manual_seed``), a network partly re-initialized
    under ``isolate_rng`` (a state saved inside the build after draws and set back), a random plain tensor attribute,
    torchmetrics metrics (states and defaults are plain attributes, not buffers) and a plain counter tensor.
    Records, per rank, what a test compares with DDP: the weights and the generators after setup, the weights after
    training, and the metrics' states after teardown."""

    def __init__(self) -> None:
        super().__init__()
        self.net: TransformerLM | None = None
        self.observed: dict[str, Any] = {}

    def configure_model(self) -> None:
        pl.seed_everything(7, verbose=False)  # also when it runs again (validate after fit): a reseed, nothing built
        if self.net is not None:
            return
        self.net = TransformerLM()
        with isolate_rng():
            torch.manual_seed(3)
            self.net.head.reset_parameters()
        nn.init.normal_(self.net.emb.weight, std=0.5)  # draws from where isolate_rng set the generator back
        self.probe = torch.rand(3)
        self.train_loss = torchmetrics.MeanMetric()
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=VOCAB)
        self.val_loss = torchmetrics.MeanMetric()
        self.val_batches = torch.zeros((), dtype=torch.int64)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        _, tokens = batch
        assert self.net is not None
        loss = lm_loss(self.net, tokens)
        self.train_loss(loss)
        self.log("train_loss", self.train_loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, tokens = batch
        assert self.net is not None
        logits = self.net(tokens[:, :-1])
        self.val_accuracy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.val_loss(lm_loss(self.net, tokens))
        self.val_batches += 1
        self.log("val_accuracy", self.val_accuracy)
        self.log("val_loss", self.val_loss)

    def on_train_start(self) -> None:
        self.observed["setup"] = full_state(self)
        self.observed["generators"] = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        self.observed["probe"] = self.probe.clone()

    def on_train_end(self) -> None:
        self.observed["trained"] = full_state(self)

    def on_validation_start(self) -> None:
        if self.trainer.validating:  # trainer.validate after fit: configure_model reseeded, built nothing
            self.observed["generators_at_validate"] = torch.get_rng_state()

    def metric_states(self) -> dict[str, Tensor | list]:
        """Every metric state and default, by name (after teardown: must be real, usable tensors)."""
        states: dict[str, Tensor | list] = {}
        for name in ("train_loss", "val_accuracy", "val_loss"):
            metric = getattr(self, name)
            for state, default in metric._defaults.items():
                states[f"{name}.{state}"] = getattr(metric, state)
                states[f"{name}._defaults.{state}"] = default
        return states

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class MetricsOnlyInConfigureModel(SeededWithMetrics):
    """The network built in ``__init__`` (whole on every rank), only the metrics and tensor attributes in
    ``configure_model``: nothing to shard was built on the meta device, the rest must still get real values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.net = TransformerLM()
        self.metrics_built = False

    def configure_model(self) -> None:
        if self.metrics_built:
            return
        self.metrics_built = True
        torch.manual_seed(9)
        self.probe = torch.rand(3)
        self.train_loss = torchmetrics.MeanMetric()
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=VOCAB)
        self.val_loss = torchmetrics.MeanMetric()
        self.val_batches = torch.zeros((), dtype=torch.int64)


def full_state(module: pl.LightningModule) -> dict[str, Tensor]:
    """The module's whole state_dict on this rank (stage 3 gathers its parameters for the copy)."""
    strategy = module.trainer.strategy
    gathered = strategy.engine.gathered_parameters() if isinstance(strategy, ZeroStrategy) else nullcontext()
    with gathered:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
