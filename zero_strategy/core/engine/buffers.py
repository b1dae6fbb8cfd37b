"""The module's buffers made equal on every rank: rank 0's values, as DDP broadcasts them at wrap time and (with
``broadcast_buffers``) before every training forward."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zero_strategy.core.comm.comm import Comm


def broadcast_buffers(module: nn.Module, comm: Comm) -> None:
    """Every non-empty buffer of ``module`` takes rank 0's values: one broadcast per (dtype, device) over
    ``comm`` (every rank of the run)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for buffer in module.buffers():
        if buffer.numel() > 0:
            by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    for group in by_kind.values():
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        comm.broadcast(flat, 0, "buffers").wait()
        offset = 0
        with torch.no_grad():
            for buffer in group:
                buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()
