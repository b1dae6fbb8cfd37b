"""Writing a FlatParam's master slice from values every rank changed alike: a whole copy of the masters (a change
of a stage-3 parameter outside forward), or the buffer the module's parameters read (a change made in place where
nothing saw it being made). See [Note: in-place changes outside the optimizer] in in_place_watch.py.

Free functions of a FlatParam (flat_param.py calls them; this module does not import it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zero_strategy.core.flat.errors import ShardedParameterError
from zero_strategy.core.flat.in_place_watch import HOST_WIDE, refuse_rounded
from zero_strategy.core.flat.param_values import point_at

FlatParam = Any  # a FlatParam (flat_param.py imports this module)


def write_whole(flat: FlatParam, whole: Tensor, label: str, in_use: bool) -> None:
    """Every rank passes the same whole padded values (laid out like the full buffer, in the masters' dtype): this
    rank keeps its range in its master slice, and every copy the module reads is refreshed (the host-wide slice
    between two barriers, the gathered buffer where it is ``in_use``, the device copy; the secondary copy goes
    stale). Collective: every rank calls it."""
    storage = flat.storage
    host_wide = storage.full.readable_in_place
    if host_wide:  # the write rule of [Note: shared-memory gathers]: peers are done reading our slice
        flat.comm.barrier(f"{label}: before the write").wait()
    start, end = storage.own_range
    with torch.no_grad():
        storage.shard.copy_(whole[start:end])
        if not host_wide and in_use:  # a private gathered copy the module reads now
            storage.full.tensor.copy_(whole)
    storage.write_own_slice()  # host-wide and not the master itself: the rounded values
    _refresh_copies(flat)
    if host_wide:  # our slice is complete before a peer reads it
        flat.comm.barrier(f"{label}: after the write").wait()


def take_changes(flat: FlatParam, source: Tensor) -> list[str]:
    """The parameters changed in place since the last baseline (their version counters moved; every rank made the
    same change to its whole copy ``source``, laid out like the full buffer) take this rank's ranges into its
    master slice, in the masters' dtype. Local. Returns their names."""
    changed = flat.in_place.take_changed()
    start, end = flat.storage.own_range
    with torch.no_grad():
        for index in changed:
            span = flat.layout.spans[index]
            lo, hi = max(span.offset, start), min(span.end, end)
            if lo < hi:
                flat.storage.shard[lo - start : hi - start].copy_(source[lo:hi])
    if changed:
        _refresh_copies(flat)
    return [flat.names[index] for index in changed]


def private_copy(flat: FlatParam) -> Tensor:
    """A host-wide FlatParam's values in this rank's own memory, the module's parameters re-pointed at it (they
    must be their own class)."""
    private = flat.storage.full.tensor.clone()
    _point_params_at(flat, private)
    return private


def take_changes_at_release(flat: FlatParam, private: Tensor | None) -> None:
    """A stage-3 unit is released: changes made in place while it was gathered reach the masters. Through the
    network (``private`` None, the gathered buffer is this rank's) and inside ``gathered_parameters()`` on one host
    (``private``: this rank's copy; a collective then, the host-wide slice being rewritten between two barriers):
    exact in fp32; in bf16/fp16 the changes the watch saw were applied to the masters already (exact_writes.py), and
    one found here would reach them rounded: refused (InPlaceChangeError). Inside forward on one host the
    parameters read the host-wide buffer in place, where a change every rank makes landed once per rank: an error,
    the backstop for a change that bypassed the check made as it happens (core/runtime/forward_writes.py)."""
    storage = flat.storage
    if storage.full.readable_in_place and private is None:
        changed = flat.in_place.take_changed()
        if changed:
            listed = ", ".join(flat.names[index] for index in changed)
            raise ShardedParameterError(f"ZeRO: {listed} changed in place outside the optimizer; {HOST_WIDE}")
        return
    if storage.full.tensor.dtype != storage.shard.dtype:  # refused before anything is written (every rank alike)
        rounded = flat.in_place.changed()
        if rounded:
            flat.in_place.forget()
            refuse_rounded([flat.names[index] for index in rounded])
    if private is None:
        take_changes(flat, storage.full.tensor)
    else:
        flat.comm.barrier(f"release of {flat.label} after gathered_parameters(): before the write").wait()
        take_changes(flat, private)
        storage.write_own_slice()
        _point_params_at(flat, storage.full.tensor)
        flat.comm.barrier(f"release of {flat.label} after gathered_parameters(): after the write").wait()


def _point_params_at(flat: FlatParam, buffer: Tensor) -> None:
    for span, param in zip(flat.layout.spans, flat.params, strict=True):
        point_at(param, buffer[span.offset : span.end].view(span.shape))
    flat.in_place.forget()  # `.data` gave each parameter a new version counter


def _refresh_copies(flat: FlatParam) -> None:
    flat.storage.refresh_device_source()
    if flat.secondary is not None:
        flat.secondary.mark_stale()
    flat.storage.after_host_read()
