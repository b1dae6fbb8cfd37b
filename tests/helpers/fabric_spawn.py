"""A Fabric training function a spawn launcher can pickle (module level), and the same math in one process."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric

from helpers.fabric_runs import GLOBAL_BATCH, Net, lm_loss

STEPS = 3
LR = 0.1


def _global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 11, (GLOBAL_BATCH, 6), generator=torch.Generator().manual_seed(500 + step))


def _initial() -> Net:
    torch.manual_seed(0)
    return Net()


def train_on_ranks(fabric: Fabric) -> dict[str, list]:
    """Each rank its slice of every global batch; the full weights back as lists (rank 0's reach the launching
    process; a tensor would travel as a file descriptor of a process that has exited by then)."""
    model = _initial()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(STEPS):
        tokens = _global_batch(step).chunk(fabric.world_size)[fabric.global_rank]
        fabric.backward(lm_loss(model, tokens))
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().tolist() for key, value in model.state_dict().items()}


def single_process_reference() -> dict[str, torch.Tensor]:
    """What DDP computes: the mean of the ranks' mean losses over equal slices is the global batch's mean loss."""
    model = _initial()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        lm_loss(model, _global_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}
