"""Stage-3 parameters used outside forward: reads computed on their values, writes applied to every rank's masters
(see [Note: parameters outside forward] in access.py and [Note: in-place changes outside the optimizer] in
in_place_watch.py).

Communication plan of one call (per FlatParam it touches, in the order the parameters appear in the call, the same
on every rank that makes it):
- a read: nothing on one host's shared memory (the values are read in place); through the network one all-gather
  of the compute-dtype slices, labelled "read of <name> outside forward", after which the buffer is freed again;
- a write: one all-gather of the master slices (fp32 under mixed precision), labelled "change of <name> outside
  forward", and, on one host's shared memory, two barriers around the rewrite of this rank's host-wide slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from zero_strategy.core.comm.comm import OUTSIDE_FORWARD, DivergedGathersError
from zero_strategy.core.flat.errors import ShardedParameterError, is_sharded
from zero_strategy.core.flat.values_copy import NoGradientThrough, as_values_copy, function_name, written_tensors

FlatParam = Any  # a FlatParam (flat_param.py, which imports this module through access.py)

# Writes that would change what a parameter *is* (its storage, its size), not its values: refused
_STRUCTURAL = frozenset({"set_", "resize_", "resize_as_", "as_strided_", "share_memory_", "detach_", "swapaxes_",
                         "swapdims_", "transpose_", "t_", "squeeze_", "unsqueeze_", "_coalesced_"})


def run_outside_forward(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` where some argument is a stage-3 parameter whose values are on other ranks: a
    write into such a parameter is applied to the masters of every rank, anything else is a read of its values."""
    sharded = _unique(t for t in tree_flatten((args, kwargs))[0] if is_sharded(t))
    written = _unique(t for t in written_tensors(func, args, kwargs) if is_sharded(t))
    if written and function_name(func) in _STRUCTURAL:
        raise ShardedParameterError(
            f"ZeRO stage 3: {function_name(func)} would change what {_name(written[0])} is (its storage or its "
            "shape), which ZeRO owns; change its values instead (copy_, mul_, ...)."
        )
    if written:
        return _write(func, args, kwargs, sharded, written)
    return _read(func, args, kwargs, sharded)


def _read(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], sharded: list[Any]) -> Any:
    by_owner = _by_owner(sharded)
    if torch.is_grad_enabled() and written_tensors(func, args, kwargs) and any(p.requires_grad for p in sharded):
        raise ShardedParameterError(
            f"ZeRO stage 3: {function_name(func)} writes what it computes from {_name(sharded[0])} into another "
            "tensor with autograd on, outside forward; do it under torch.no_grad()."
        )
    with ExitStack() as stack:
        for owner, params in by_owner:  # a collective through the network: every rank reads (see the module doc)
            stack.enter_context(owner.gathered(f"read of {_names(params)}{OUTSIDE_FORWARD}"))
        # the parameters are their own class now; the call sees detached stand-ins so that what it returns is
        # not tied to the parameter (autograd's link is made below, to a node that refuses a gradient)
        stand_ins = {id(p): p.detach().requires_grad_(p.requires_grad) for p in sharded}
        result = func(*_substituted(args, stand_ins), **_substituted(kwargs, stand_ins))
        buffers = {owner.full.untyped_storage().data_ptr(): params for owner, params in by_owner}
        if isinstance(result, Iterator):  # iter(p): its elements are views, read before the buffer goes
            return iter([_private(item, buffers, sharded) for item in result])
        return tree_map(lambda value: _private(value, buffers, sharded), result)


def _private(value: Any, buffers: dict[int, list[Any]], sharded: list[Any]) -> Any:
    """A result as the caller may keep it: no memory of a gathered or host-wide buffer (a copy that refuses writes
    where DDP's would have been a view), and a gradient never flowing back into the shards."""
    if not isinstance(value, Tensor):
        return value
    aliased = buffers.get(value.untyped_storage().data_ptr())
    kept = value.detach().clone() if aliased is not None else value
    if value.requires_grad:  # as DDP's would; its backward raises (see NoGradientThrough)
        anchor = next(p for p in sharded if p.requires_grad)
        kept = NoGradientThrough.apply(anchor, kept.detach(), _names(sharded))
    return as_values_copy(kept, _names(aliased)) if aliased is not None else kept


def _write(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], sharded: list[Any], written: list[Any]
) -> Any:
    """Apply the write to a whole copy of the masters on every rank; each keeps its own range. Every parameter of
    the call is seen in the masters' dtype (DDP's fp32 parameter under mixed precision)."""
    by_owner = _by_owner(sharded)
    written_ids = {id(p) for p in written}
    wholes: dict[int, Tensor] = {}
    substitutes: dict[int, Tensor] = {}
    for owner, params in by_owner:  # a collective on every transport: every rank makes the change
        owner.land_prefetch()  # a gather in flight lands before the slices change
        changed = [p for p in params if id(p) in written_ids]
        what = "change" if changed else "read"
        whole = gather_masters(owner, f"{what} of {_names(changed or params)}{OUTSIDE_FORWARD}")
        wholes[id(owner)] = whole
        for param in params:
            span = owner.layout.spans[_index_in(owner, param)]
            # requires_grad as the parameter's: torch itself refuses an in-place change with autograd on
            view = whole[span.offset : span.end].view(span.shape).detach()
            substitutes[id(param)] = view.requires_grad_(param.requires_grad)
    result = func(*_substituted(args, substitutes), **_substituted(kwargs, substitutes))
    for owner, params in by_owner:
        changed = [p for p in params if id(p) in written_ids]
        if changed:
            owner.write_whole(wholes[id(owner)], f"change of {_names(changed)}{OUTSIDE_FORWARD}")
    originals = {id(substitutes[id(param)]): param for param in sharded}
    # the call returns what it wrote into (p.mul_(2) returns p): the parameter itself, as under DDP
    return tree_map(lambda value: originals.get(id(value), value), result)


def gather_masters(owner: FlatParam, label: str) -> Tensor:
    """Every rank's master slice of ``owner``, through an exchange that pairs only with the same one on the peers:
    a rank that changes a parameter alone waits until the divergence watch (network path) or the process group's
    timeout (one host's shared memory) stops it, and never mixes its masters with another exchange's bytes."""
    device = owner.full.device
    whole = torch.empty(owner.layout.padded_numel, dtype=owner.shard.dtype, device=device)
    try:
        owner.comm.pairing_by_label.all_gather(whole, owner.shard.to(device, copy=True), label).wait()
        return whole
    except DivergedGathersError:
        raise
    except RuntimeError as error:  # a timeout: some rank never made the change
        raise ShardedParameterError(
            f"ZeRO: the {label} waited for ranks that never made it ({error}). A change of a parameter whose "
            "masters are sharded (stage 3, or bf16/fp16 parameters) is a collective: make it on every rank, as "
            "under DDP every replica must make it."
        ) from error


def _substituted(tree: Any, substitutes: dict[int, Tensor]) -> Any:
    return tree_map(lambda value: substitutes.get(id(value), value) if is_sharded(value) else value, tree)


def _by_owner(params: list[Any]) -> list[tuple[FlatParam, list[Any]]]:
    """The FlatParams of ``params`` in the order they first appear, each with its parameters of the call."""
    grouped: dict[int, tuple[FlatParam, list[Any]]] = {}
    for param in params:
        owner = param.__dict__["_zero_owner"]()
        if owner is None:
            raise ShardedParameterError(f"{_name(param)}: its engine is gone")
        grouped.setdefault(id(owner), (owner, []))[1].append(param)
    return list(grouped.values())


def _index_in(owner: FlatParam, param: Any) -> int:
    return next(index for index, own in enumerate(owner.params) if own is param)


def _unique(tensors: Iterator[Any]) -> list[Any]:
    return list({id(t): t for t in tensors}.values())


def _name(param: Any) -> str:
    return str(param.__dict__.get("_zero_name", "a parameter"))


def _names(params: list[Any]) -> str:
    return ", ".join(_name(p) for p in params)
