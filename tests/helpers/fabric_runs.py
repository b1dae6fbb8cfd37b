"""Small Fabric training loops shared by the Fabric tests: one model, one data stream, every rank its own slice of
each global batch, so that Fabric's DDP and the ZeRO strategies compute the same global math."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn

GLOBAL_BATCH = 8  # samples per micro-step, split over the ranks (world 1, 2, 4)


class Net(nn.Module):
    """An embedding, normalization and a list of blocks (each block a ZeRO unit), and a head."""

    def __init__(self, width: int = 16, blocks: int = 3, vocab: int = 11) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.Tanh())
                                    for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batch(step: int, micro: int, fabric: Fabric, vocab: int = 11) -> torch.Tensor:
    """This rank's share of global micro-batch (step, micro): tokens of shape (GLOBAL_BATCH / world, 6)."""
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, 6), generator=torch.Generator().manual_seed(1000 * step + micro))
    return tokens.chunk(fabric.world_size)[fabric.global_rank]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(fabric: Fabric, model: nn.Module, optimizers: list[Any], steps: int, accumulation: int = 2,
          clip: Callable[[Fabric, nn.Module, Any], Any] | None = None, first_step: int = 0,
          loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lm_loss) -> None:
    """``steps`` optimizer steps of ``accumulation`` micro-batches, the first ones under ``no_backward_sync``."""
    for step in range(first_step, first_step + steps):
        for micro in range(accumulation):
            with fabric.no_backward_sync(model, enabled=micro < accumulation - 1):
                fabric.backward(loss_of(model, batch(step, micro, fabric)) / accumulation)
        for optimizer in optimizers:
            if clip is not None:
                clip(fabric, model, optimizer)
            optimizer.step()
            optimizer.zero_grad()


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full state dict, fp32 (a collective at stage 3: every rank calls it)."""
    return {key: value.detach().float().clone() for key, value in module.state_dict().items()}
