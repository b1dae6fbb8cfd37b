"""Models for ``zero-estimate --model helpers.estimate_models:Name`` (tests/tools/test_estimate_model.py). Each
records the device of every tensor its constructor made, so a test can tell a meta build from a real one."""

from __future__ import annotations

import torch
from torch import nn

TENSORS_MADE_ON: list[str] = []
"""The device type of each tensor a constructor below made, in order (cleared by the tests)."""


class SizedByItsOwnTable(nn.Module):
    """Reads a tensor's value in its constructor: it cannot be built on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(4.0))
        TENSORS_MADE_ON.append(self.table.device.type)
        width = int(self.table.sum().item())  # the value decides a shape
        self.proj = nn.Linear(width, width)
        TENSORS_MADE_ON.append(self.proj.weight.device.type)


class PinsItsDevice(nn.Module):
    """Asks for CPU tensors explicitly: ``torch.device("meta")`` alone would leave them on the CPU."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, width, device="cpu")
        self.blocks = nn.ModuleList(nn.Linear(width, width, device=torch.device("cpu")) for _ in range(3))
        self.register_buffer("positions", torch.zeros(16, width, device="cpu"))
        TENSORS_MADE_ON.extend(t.device.type for t in [*self.parameters(), *self.buffers()])
