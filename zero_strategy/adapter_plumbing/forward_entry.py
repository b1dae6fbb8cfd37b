"""The module a ZeRO strategy hands its framework as the forward module: where every step's forward enters."""

from __future__ import annotations

from typing import Any

from torch import nn


class ForwardEntry(nn.Module):
    """Wraps the user's module so that every forward the framework routes through it (the Trainer's
    ``training_step``/``validation_step``, Fabric's ``model(x)`` and the methods Fabric redirects through forward)
    runs inside the root unit's gather/free hooks, whatever the step touches. Its ``module`` is the user's."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
