"""LightningModules that read and change parameters outside forward the way code written for DDP does (issue 34,
items 2 and 7): a clone before the optimizer step and the difference after it, a norm logged in a hook, in-place
changes every rank makes (``mul_``, a re-initialisation, ``p[i] = v``, ``load_state_dict`` into the running model),
and a read only rank 0 makes. Each records what it saw, so that a test compares ZeRO with DDP doing the same."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from helpers.models import TiedLM, lm_loss


class ReadsAndChanges(pl.LightningModule):
    """Automatic optimization; every rank reads and changes parameters outside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.seen: dict[str, list[Tensor]] = {"before": [], "delta": [], "norm": [], "bias": []}
        self._before: Tensor | None = None
        torch.manual_seed(5)
        self.loaded = {k: v.detach().clone() for k, v in TiedLM(n_blocks=2).state_dict().items()}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        weight = self.net.blocks[1].fc.weight
        self.seen["norm"].append(weight.norm().detach())  # a hook reading a weight, as a logging callback does
        with torch.no_grad():  # in-place changes every rank makes, as DDP code makes them
            if batch_idx == 1:
                weight.mul_(0.5)
                self.net.blocks[1].fc.bias[0] = 0.75
            if batch_idx == 2:
                torch.manual_seed(7)
                self.net.blocks[0].fc.reset_parameters()
        if batch_idx == 3:
            self.net.load_state_dict(self.loaded)  # into the running model

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        _, tokens = batch
        self._before = self.net.blocks[1].fc.weight.clone()  # read before the step: DDP's values
        self.seen["before"].append(self._before.detach())
        return lm_loss(self.net, tokens)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self._before is not None
        self.seen["delta"].append((self.net.blocks[1].fc.weight - self._before).detach())  # what the step did
        self.seen["bias"].append(torch.tensor(self.net.blocks[0].fc.bias.tolist()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class RankZeroRead(ReadsAndChanges):
    """Rank 0 alone reads a weight (a logging callback under ``rank_zero_only``)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._log_norm()

    @rank_zero_only
    def _log_norm(self) -> None:
        self.seen["norm"].append(self.net.blocks[1].fc.weight.norm().detach())


def seen_tensors(module: ReadsAndChanges) -> dict[str, Tensor]:
    """Everything the module recorded, and its final weights, by a path-like name."""
    flat = {f"final/{k}": v.detach().clone() for k, v in module.state_dict().items()}
    for what, values in module.seen.items():
        flat |= {f"{what}/{step}": value for step, value in enumerate(values)}
    return flat
