"""A tiny mixture-of-experts model whose routing depends on the rank, and a DDP(find_unused_parameters=True) run
of it as the reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

WIDTH = 7  # odd: every unit is padded for world sizes 2 and 4
N_EXPERTS = 3
# ROUTES[step][rank % 2]: the experts a rank calls in that step. Step 0: each rank uses a different expert and
# expert 2 is used by no rank; step 2: no rank uses expert 1; step 4: only rank 0 uses anything beyond expert 0.
ROUTES = [
    [(0,), (1,)],
    [(0, 1, 2), (0, 1, 2)],
    [(2,), (0,)],
    [(1,), (1, 2)],
    [(0, 2), (0,)],
    [(1, 2), (2,)],
]


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


class TinyMoE(nn.Module):
    """Input projection → router + experts (a ModuleList) → head. ``route`` says which experts this call uses."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.router = nn.Linear(width, N_EXPERTS)
        self.experts = nn.ModuleList(Expert(width) for _ in range(N_EXPERTS))
        self.head = nn.Linear(width, 1)
        self.route: tuple[int, ...] = tuple(range(N_EXPERTS))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.proj(x))
        gates = torch.softmax(self.router(h), dim=-1)
        mixed = h
        for e in self.route:
            mixed = mixed + gates[:, e : e + 1] * self.experts[e](h)
        return self.head(mixed)


def make_moe(seed: int = 0) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE()


def moe_batches(steps: int, global_batch: int, seed: int = 3) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(global_batch, WIDTH, generator=generator), torch.randn(global_batch, 1, generator=generator))
        for _ in range(steps)
    ]


def train_moe(
    model: nn.Module,
    inner: TinyMoE,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
    step: Callable[[], None] | None = None,
) -> None:
    """One SGD/AdamW step per batch, each rank on its slice of the global batch with its own routing.
    ``step``: how to step (ZeRO: the engine's ``optimizer_step``); default ``optimizer.step()``."""
    for index, (x, y) in enumerate(moe_batches(len(ROUTES), 4 * world_size)):
        inner.route = ROUTES[index][rank % 2]
        per_rank = x.shape[0] // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        (step or optimizer.step)()
