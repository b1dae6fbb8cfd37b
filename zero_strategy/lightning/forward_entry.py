"""The module ZeroStrategy hands Lightning as ``strategy.model``: where every step's forward enters."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from torch import nn


class ForwardEntry(nn.Module):
    """The module Lightning calls for every step (through its forward redirection), so that the root unit's
    gather/free hooks run around ``training_step`` / ``validation_step`` whatever the step touches."""

    def __init__(self, module: LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
