"""Parameters that produced no gradient in a step are not stepped.

[Note: unused parameters]
torch optimizers skip a parameter whose ``.grad`` is None: no weight decay, no momentum, no change. A master slice
covers several parameters, and the reduced slice holds zeros where a parameter produced no gradient, so an
optimizer would decay and move it. Pieces made only of such parameters get ``grad=None`` (the optimizer skips
them, state untouched); in mixed pieces the unused elements and their element-wise optimizer state are put back
after the step. "Unused" is decided from this rank's own backward: like stages 2/3's collective order, this
assumes every rank uses the same set of parameters in a step (see [Note: collective order] in hooks.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.optim import Optimizer

from zero_strategy.core.flat_param import FlatParam

Saved = list[tuple[Tensor, Tensor]]  # (view into a master piece or its state, copy to put back after the step)


def protect_unused(flats: Iterable[FlatParam], optimizer: Optimizer) -> Saved:
    """Before the step: drop gradients of wholly unused pieces, remember unused elements of the others."""
    saved: Saved = []
    for flat in flats:
        unused = flat.unused_ranges()
        if not unused:
            continue
        for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
            end = offset + piece.numel()
            inside = [
                (max(lo, offset) - offset, min(hi, end) - offset) for lo, hi in unused if lo < end and hi > offset
            ]
            if not inside:
                continue
            if sum(hi - lo for lo, hi in inside) == piece.numel():
                piece.grad = None  # nothing in it was used: the optimizer skips it entirely
                continue
            tensors = [piece.data] + [
                value for value in optimizer.state.get(piece, {}).values()
                if isinstance(value, Tensor) and value.shape == piece.shape and value.dim() > 0
            ]
            saved += [(t[lo:hi], t[lo:hi].clone()) for t in tensors for lo, hi in inside]
    return saved


def restore_unused(saved: Saved) -> None:
    """After the step: put the unused elements (and their optimizer state) back."""
    for view, original in saved:
        view.copy_(original)
