"""Parameters that produced no gradient in a step are not stepped.

[Note: unused parameters]
torch optimizers skip a parameter whose ``.grad`` is None: no weight decay, no momentum, no change. A master slice
covers several parameters, and the reduced slice holds zeros where a parameter produced no gradient, so an
optimizer would decay and move it. Pieces made only of such parameters get ``grad=None`` (the optimizer skips
them, state untouched); in mixed pieces the unused elements and their element-wise optimizer state are put back
after the step.

"Unused" means unused on *every* rank, as with DDP(find_unused_parameters=True): a parameter that one rank used
(mixture-of-experts routing, a branch taken on some batches) gets the average of every rank's gradient, zeros from
the ranks that did not use it, and is stepped everywhere. Ranks agree once per optimizer step: each contributes a
bitmap of the parameters it produced a gradient for since the last step, and one all-reduce (MAX, one byte per
parameter tensor of the optimizer; through the shared-memory counters on one host's CPU ranks) gives every rank the
same answer, so every rank steps the same elements.

A gradient stays until ``zero_grad()`` (an optimizer step does not consume it, as under torch), so "used" means
"produced a gradient on some rank since the gradient was last cleared": an optimizer that steps again without
``zero_grad()``, or a second optimizer stepping the same parameters, steps what DDP's would (see [Note: optimizers
sharing parameters] in window.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from zero_strategy.core.comm.comm import Comm, ReduceOp
from zero_strategy.core.comm.streams import host_to_device
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.once import first_time

Saved = list[tuple[Tensor, Tensor]]  # (view into a master piece or its state, copy to put back after the step)


def agree_on_used(flats: list[FlatParam], comm: Comm, with_pending: bool = False) -> list[bool]:
    """Collective over ``comm`` (every rank of the run): make every FlatParam's ``grads.seen`` mean "some rank
    produced a gradient for it since it was last cleared". With ``with_pending`` (stage 1, whose gradients wait on
    the module) the same exchange also tells, per FlatParam, whether some rank holds gradients not reduced yet:
    returned in ``flats``' order, so that every rank reduces the same FlatParams (empty without ``with_pending``)."""
    for flat in flats:
        flat.grads.note_local_use()
    seen = [seen for flat in flats for seen in flat.grads.seen]
    pending = [flat.grads.has_pending() for flat in flats] if with_pending else []
    bits = seen + pending
    if not bits:
        return []
    bitmap = host_to_device(torch.tensor(bits, dtype=torch.uint8), comm.group.device, torch.uint8)
    agreed_on_device = comm.all_reduce(bitmap, ReduceOp.MAX, "the used-parameter agreement").wait()
    if all(bits):
        # The maximum of a bitmap of ones is ones whatever the peers sent: nothing to read back, so the common
        # case (every parameter used here) costs no host synchronisation on a GPU.
        return pending
    agreed = agreed_on_device.tolist()
    offset = 0
    for flat in flats:
        flat.grads.seen = [bool(used) for used in agreed[offset : offset + len(flat.grads.seen)]]
        offset += len(flat.grads.seen)
    return [bool(flag) for flag in agreed[offset:]]


def protect_unused(flats: Iterable[FlatParam], optimizer: Optimizer) -> Saved:
    """Before the step: drop gradients of wholly unused pieces, remember unused elements of the others."""
    saved: Saved = []
    for flat in flats:
        unused = flat.grads.unused_ranges(flat.rank)
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
            state = optimizer.state.get(piece, {})
            if "step" in state:
                _warn_shared_step_counter(flat, inside, offset)
            tensors = [piece.data] + [
                value for value in state.values()
                if isinstance(value, Tensor) and value.shape == piece.shape and value.dim() > 0
            ]
            saved += [(t[lo:hi], t[lo:hi].clone()) for t in tensors for lo, hi in inside]
    return saved


def _warn_shared_step_counter(flat: FlatParam, inside: list[tuple[int, int]], offset: int) -> None:
    """Elements are put back exactly, but a per-tensor step counter (Adam's bias correction) is one per master
    piece: it advances for the unused parameters too, which torch would not do. Said once per FlatParam."""
    if not first_time(("shared step counter", id(flat))):  # see [Note: once per process] in core/once.py
        return
    names = {o.name for o in flat.layout.overlaps(flat.rank)
             if any(o.shard_start < offset + hi and o.shard_start + o.numel > offset + lo for lo, hi in inside)}
    warnings.warn(
        f"ZeRO: parameters {sorted(names)} produced no gradient on any rank in a step but share a master piece with "
        "parameters that did; they are not moved, but the optimizer's step counter of that piece advances for them "
        "(Adam's bias correction then differs slightly from DDP's). Make them a unit of their own (e.g. each expert "
        "one unit, the default for ModuleList children) to be exact.",
        stacklevel=3,
    )


def restore_unused(saved: Saved) -> None:
    """After the step: put the unused elements (and their optimizer state) back."""
    # ZeRO's own write, which a check of writes inside forward must not see (a manual step inside training_step, at
    # stage 3 on one host: the views are of master pieces in the host-wide buffer; core/runtime/forward_writes.py)
    with torch._C.DisableTorchFunction():
        for view, original in saved:
            view.copy_(original)
