"""Flattening a FlatParam's gradients into one buffer laid out like its ``full`` (the input of a reduction)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from zero_strategy.core.layout import FlatLayout


class HoldsGradients(Protocol):
    """What flattening reads and releases of a FlatParam."""

    layout: FlatLayout
    params: list[nn.Parameter]
    grad_seen: list[bool]
    grad_stash: Tensor | None
    full: Tensor


def flatten_grads(flat: HoldsGradients, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """``flat``'s module gradients laid out like ``full`` (zeros where a parameter has none, and in the padding),
    in ``out`` when given (a shared-memory arena, see [Note: shared-memory reductions]) or a new tensor. The module's
    ``.grad`` tensors (and a stage-1 stash) are released: the result is now the only copy."""
    stash, flat.grad_stash = flat.grad_stash, None
    if out is not None:
        target = out
    elif stash is not None:
        target = stash.to(dtype)  # the stash itself when it has the dtype already
    else:
        target = torch.empty(flat.layout.padded_numel, dtype=dtype, device=flat.full.device)
    if stash is not None:
        if target is not stash:
            target.copy_(stash)
        add = True
    else:  # copy rather than zeros + add: one pass over the memory instead of two
        target[flat.layout.numel :].zero_()
        add = False
    for index, (span, param) in enumerate(zip(flat.layout.spans, flat.params, strict=True)):
        part = target[span.offset : span.end]
        if param.grad is not None:
            part.add_(param.grad.reshape(-1)) if add else part.copy_(param.grad.reshape(-1))
            param.grad = None
            flat.grad_seen[index] = True
        elif not add:
            part.zero_()
    return target


def stash_grad(flat: HoldsGradients, index: int) -> None:
    """Move parameter ``index``'s gradient into ``flat``'s fp32 stash (stage 1 in low precision accumulates there,
    not in the compute dtype)."""
    param = flat.params[index]
    if param.grad is None:
        return
    if flat.grad_stash is None:
        flat.grad_stash = torch.zeros(flat.layout.padded_numel, dtype=torch.float32, device=flat.full.device)
    span = flat.layout.spans[index]
    flat.grad_stash[span.offset : span.end].add_(param.grad.reshape(-1))
    param.grad = None
    flat.grad_seen[index] = True
