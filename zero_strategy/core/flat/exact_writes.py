"""A change made in place to a whole parameter whose fp32 masters are kept apart from it in a lower precision
(bf16/fp16: stages 1/2 outside forward, stage 3 inside ``gathered_parameters()``), applied to the masters exactly, as
stage 3 applies a change outside forward (see [Note: in-place changes outside the optimizer] in in_place_watch.py).

The parameter holds its values rounded to bf16/fp16; DDP's fp32 parameter holds them unrounded. A change computed
from the rounded values (``p.mul_(0.5)``) and taken into the masters afterwards would be rounded twice, so the call
is replayed instead: every rank gathers the FlatParam's master slices into a whole fp32 copy, runs the call on it in
place of the parameter (DDP's exact arithmetic, the same random draws for ``torch.nn.init``), keeps its own range in
its master slice and rewrites the buffer the module reads from the whole copy (rounded once, as the next step's
publish would: the gathered buffer, or inside ``gathered_parameters()`` on one host this rank's private copy and its
host-wide slice between two barriers). The parameter itself is never written, so the version-counter watch sees no
change to take in twice. Communication plan per call and FlatParam it touches: one all-gather of the master slices
(the masters' dtype), labelled "change of <name> outside forward". A collective: every rank makes the change, as
every DDP replica must; one rank changing alone waits until the divergence watch or the process group's timeout stops
it (outside_forward.gather_masters)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from zero_strategy.core.comm.comm import OUTSIDE_FORWARD
from zero_strategy.core.flat.outside_forward import gather_masters

FlatParam = Any  # a FlatParam (flat_param.py, which imports this module through grad_reads.py)


def replays_writes(flat: FlatParam) -> bool:
    """Whether a change made in place to ``flat``'s whole parameters must be replayed on its masters to be exact:
    they are kept in a higher precision than the parameters (bf16/fp16; stages 1/2 outside forward, stage 3 inside
    ``gathered_parameters()``)."""
    return bool(flat.trainable and flat.full.dtype != flat.shard.dtype)


def replay_write(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 owners: list[tuple[FlatParam, list[Any]]], written: list[Any]) -> Any:
    """Run ``func(*args, **kwargs)``, which writes into some of the parameters of ``owners`` (each FlatParam with
    its parameters named in the call), on whole copies of their masters; each rank keeps its own range. Returns what
    the call returns, with the parameter itself where it returns a written copy (``p.mul_(2)`` returns ``p``)."""
    written_ids = {id(p) for p in written}
    wholes: dict[int, Tensor] = {}
    substitutes: dict[int, Tensor] = {}
    for owner, params in owners:
        owner.land_prefetch()  # a gather in flight (stages 1/2 re-gather after a step) lands before the rewrite
        changed = [p for p in params if id(p) in written_ids]
        names = ", ".join(owner.names[_index_in(owner, p)] for p in (changed or params))
        whole = gather_masters(owner, f"{'change' if changed else 'read'} of {names}{OUTSIDE_FORWARD}")
        wholes[id(owner)] = whole
        for param in params:
            span = owner.layout.spans[_index_in(owner, param)]
            # requires_grad as the parameter's: torch itself refuses an in-place change with autograd on
            view = whole[span.offset : span.end].view(span.shape).detach()
            substitutes[id(param)] = view.requires_grad_(param.requires_grad)
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*tree_map(lambda v: substitutes.get(id(v), v), args),
                      **tree_map(lambda v: substitutes.get(id(v), v), kwargs))
    for owner, params in owners:
        changed = [p for p in params if id(p) in written_ids]
        if changed:
            names = ", ".join(owner.names[_index_in(owner, p)] for p in changed)
            owner.write_whole(wholes[id(owner)], f"change of {names}{OUTSIDE_FORWARD}")
    originals = {id(substitutes[id(p)]): p for _, params in owners for p in params}
    return tree_map(lambda value: originals.get(id(value), value), result)


def _index_in(owner: FlatParam, param: Any) -> int:
    return next(index for index, own in enumerate(owner.params) if own is param)
