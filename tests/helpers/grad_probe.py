"""A small model whose parameters cover what gradient reads must get right: accumulation over 2 micro-batches, a
parameter only rank 0 uses (in the window's second micro-batch), one no rank uses, a frozen one (shared by the
grad_norm and p.grad tests)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

STEPS = 2


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 7)
        self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(2))
        self.frozen = nn.Linear(7, 7).requires_grad_(False)
        self.branch = nn.Linear(7, 7)  # only rank 0 uses it
        self.unused = nn.Linear(7, 7)  # no rank does
        self.out = nn.Linear(7, 2)

    def forward(self, x: Tensor, use_branch: bool) -> Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        h = self.frozen(h)
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def make_probe() -> tuple[Probe, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Probe()
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def micro_batches(rank: int, step: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(2)]


def probe_loss(model: nn.Module, batch: tuple[Tensor, Tensor], rank: int, second: bool = True) -> Tensor:
    """Rank 0 uses the branch in the window's second micro-batch only: a parameter no rank had used when the
    norms were read mid-window must still be stepped on every rank."""
    x, y = batch
    return nn.functional.mse_loss(model(x, use_branch=rank == 0 and second), y) / 2  # accumulation over 2
