"""Lightning patterns that break naive sharding: a manual optimization step with two forwards and two backwards (a
closure), parameters read after the step, the module's state_dict inside the step, a deep copy of the network at fit
start. Each records what it saw, per rank, so a test compares ZeRO with DDP doing the same."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from helpers.models import TiedLM, lm_loss
from zero_strategy.core.flat.access import ShardedParameterError


def _gathered(trainer: pl.Trainer) -> Any:
    gathered = getattr(trainer.strategy, "gathered_parameters", None)
    return gathered() if gathered is not None else nullcontext()


class Patterns(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.automatic_optimization = False
        self.seen: dict[str, Any] = {"after_step": [], "state_dict": [], "outside_read": []}

    def on_fit_start(self) -> None:
        # Lightning's StochasticWeightAveraging and EMA callbacks deep-copy the module here
        self.seen["deepcopy"] = {k: v.detach().clone() for k, v in copy.deepcopy(self.net).state_dict().items()}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        try:  # a plain read outside forward, every rank: DDP's values at every stage
            self.seen["outside_read"].append(float(self.net.blocks[1].fc.weight.sum()))
        except ShardedParameterError as error:
            self.seen["outside_read"].append(str(error))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        _, tokens = batch
        first, second = tokens[:2], tokens[2:]
        opt.zero_grad()
        self.manual_backward(lm_loss(self.net, first) / 2, retain_graph=True)  # the closure's first pass
        self.manual_backward(lm_loss(self.net, second) / 2)  # a second forward after a backward
        opt.step()
        with _gathered(self.trainer):  # a parameter read after the step
            self.seen["after_step"].append(self.net.blocks[1].fc.weight.detach().clone())
        self.seen["state_dict"].append({k: v.clone() for k, v in self.state_dict().items()})  # gathers under ZeRO

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def patterns_result(module: Patterns) -> dict[str, Any]:
    return {"seen": module.seen, "final": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def tensors_of(result: dict[str, Any]) -> dict[str, Tensor]:
    """Every tensor a run recorded, by a path-like name (for a comparison with DDP's)."""
    flat: dict[str, Tensor] = {f"final/{k}": v for k, v in result["final"].items()}
    flat |= {f"deepcopy/{k}": v for k, v in result["seen"]["deepcopy"].items()}
    for step, value in enumerate(result["seen"]["after_step"]):
        flat[f"after_step/{step}"] = value
    for step, state in enumerate(result["seen"]["state_dict"]):
        flat |= {f"state_dict/{step}/{k}": v for k, v in state.items()}
    return flat
