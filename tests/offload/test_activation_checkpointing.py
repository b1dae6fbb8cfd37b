"""Activation checkpointing: identical weights to no checkpointing at every stage, and at most half the memory kept
alive for backward by a deep model."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from offload.test_offload import measure_in_fresh_process
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.core.runtime.activation_checkpointing import (
    apply_activation_checkpointing,
    make_policy,
    remove_activation_checkpointing,
)
from zero_strategy.process_memory import status_bytes
from zero_strategy.testing import run_ranks


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Deep(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(rank: int, world: int, stage: int, checkpointing: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Deep()
    if checkpointing:
        assert apply_activation_checkpointing(model, make_policy([Block]), offload_to_cpu=False) == 6
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, min_unit_numel=10**9))
    data = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(2))
    for step in data:
        opt.zero_grad()
        model(step[rank * 4 : (rank + 1) * 4]).pow(2).mean().backward()
        engine.optimizer_step(opt)
    engine.release()
    remove_activation_checkpointing(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpointing_gives_identical_weights(stage: int) -> None:
    plain = run_ranks(train, 2, stage, False, timeout_s=60)[0]
    recomputed = run_ranks(train, 2, stage, True, timeout_s=60)[0]
    for key, value in plain.items():
        assert torch.equal(recomputed[key], value), key


def kept_for_backward(rank: int, world: int, checkpointing: bool) -> int:
    """Resident bytes that a forward leaves alive until backward (activations), measured in the process.
    A fixed malloc mmap threshold makes freed buffers leave RSS at once (see test_offload.py)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)
    torch.manual_seed(0)
    model = Deep(width=256, depth=12)
    if checkpointing:
        apply_activation_checkpointing(model, make_policy(["Block"]), offload_to_cpu=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, min_unit_numel=10**9))
    x = torch.randn(512, 256)
    before = status_bytes("VmRSS")
    loss = model(x).pow(2).mean()
    kept = status_bytes("VmRSS") - before
    loss.backward()
    engine.reduce_pending(opt)
    return kept


@pytest.mark.timeout(90)
def test_checkpointing_halves_memory_kept_for_backward() -> None:
    plain = measure_in_fresh_process("test_activation_checkpointing.kept_for_backward", False)
    recomputed = measure_in_fresh_process("test_activation_checkpointing.kept_for_backward", True)
    for rank in range(2):
        assert recomputed[rank] <= 0.5 * plain[rank], (plain, recomputed)
