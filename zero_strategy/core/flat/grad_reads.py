"""Where a user's read of ``p.grad`` (and a change made in place) is seen at stages 1/2: a class the parameters take
from the end of a backward to the next forward (those whose changes are replayed on the masters, core/flat/
exact_writes.py, also from the engine's start and after each forward), whose reads of ``.grad`` are answered by the
engine (see [Note: p.grad as under DDP] in
core/engine/ddp_gradients.py; stage 3's parameters have their sharded class outside forward, core/flat/access.py,
which answers the same way).

Every other operation on a watched parameter goes through unchanged and returns plain tensors; forward unwatches
the parameters first, so forward and backward never pay for it. ZeRO's own reads use ``access.own_grad`` (torch's
attribute), never this. ``nn.Module.zero_grad()`` reads ``.grad`` only to clear it (Lightning calls it at the start
of every fit and before a validation outside an accumulation window): nothing is gathered for it, and the
parameter's gradient in the slices is cleared as DDP's ``p.grad`` is.
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from zero_strategy.core.flat.exact_writes import replay_write, replays_writes
from zero_strategy.core.flat.values_copy import written_tensors
from zero_strategy.core.plan.tensor_parallel import is_distributed

WATCHED_KEY = "_zero_grad_reads"  # a watched parameter's FlatParam (a weak reference)


class ShardedGradientWarning(UserWarning):
    """Kept so that warning filters naming it still import: reads of ``p.grad`` now return DDP's values (see
    [Note: p.grad as under DDP]) and nothing emits it."""


def is_grad_getter(func: Any) -> bool:
    """Whether ``__torch_function__`` was called for a read of ``.grad``."""
    owner = getattr(func, "__self__", None)
    return getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") == "grad"


def is_grad_setter(func: Any) -> bool:
    """Whether ``__torch_function__`` was called for an assignment ``p.grad = value``."""
    owner = getattr(func, "__self__", None)
    return getattr(func, "__name__", "") == "__set__" and getattr(owner, "__name__", "") == "grad"


def answer_grad_write(param: Tensor, owner: Any, value: Tensor | None) -> None:
    """A user's ``param.grad = value``, called from a ``__torch_function__``: the engine takes it into its
    gradient slices through ``owner`` (its FlatParam), or, where the engine does not step the parameter (or is
    gone), torch's attribute is set. ``nn.Module.zero_grad`` assigns None after its read cleared the gradient
    (see :func:`answer_grad_read`): torch's attribute only."""
    zero_grad = sys._getframe(2).f_code is nn.Module.zero_grad.__code__
    if owner is None or zero_grad or not owner.write_grad(param, value):
        with torch._C.DisableTorchFunctionSubclass():
            param.grad = value


def answer_grad_read(param: Tensor, owner: Any, torch_value: Tensor | None) -> Tensor | None:
    """A user's read of ``param.grad``, called from a ``__torch_function__``: the engine's answer through
    ``owner`` (its FlatParam; None once the engine is gone). ``nn.Module.zero_grad`` reads it only to clear it:
    torch's attribute, and the engine clears the parameter's gradient as DDP's is cleared. Frame 2 is the code
    that read the attribute (frame 1 the ``__torch_function__``)."""
    if owner is None:
        return torch_value
    if sys._getframe(2).f_code is nn.Module.zero_grad.__code__:  # DDP's gradient goes: ours too
        owner.forget_grad(param)
        return torch_value
    return owner.read_grad(param, torch_value)


class _GradWatched:
    """Mixed in before a stage-1/2 parameter's own class between a backward and the next forward."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_grad_setter(func):
            owner = args[0].__dict__.get(WATCHED_KEY)
            answer_grad_write(args[0], owner() if owner is not None else None, args[1])
            return None
        written = [t for t in written_tensors(func, args, kwargs or {}) if isinstance(t, _GradWatched)]
        owners = _replaying_owners((args, kwargs)) if written else []
        if any(id(p) in {id(q) for _, params in owners for q in params} for p in written):
            return replay_write(func, tuple(args), dict(kwargs or {}), owners, written)  # see exact_writes.py
        with torch._C.DisableTorchFunctionSubclass():
            value = func(*args, **(kwargs or {}))
        if is_grad_getter(func):
            owner = args[0].__dict__.get(WATCHED_KEY)
            return answer_grad_read(args[0], owner() if owner is not None else None, value)
        return value

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy (an EMA callback's) is a parameter of the parameter's own class, with torch's ``.grad``."""
        with _as_own(self):
            return copy.deepcopy(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        with _as_own(self):
            return self.__reduce_ex__(protocol)


def _replaying_owners(tree: Any) -> list[tuple[Any, list[Any]]]:
    """The FlatParams whose masters a change must be replayed on (exact_writes.replays_writes), each with its
    watched parameters found in ``tree``, in the order they first appear."""
    grouped: dict[int, tuple[Any, list[Any]]] = {}
    for value in tree_flatten(tree)[0]:
        entry = value.__dict__.get(WATCHED_KEY) if isinstance(value, _GradWatched) else None
        owner = entry() if entry is not None else None
        if owner is not None and replays_writes(owner):
            params = grouped.setdefault(id(owner), (owner, []))[1]
            if not any(p is value for p in params):
                params.append(value)
    return list(grouped.values())


@contextmanager
def _as_own(param: Any) -> Iterator[None]:
    """The parameter with its own class and without the watch's entry, for the block's duration."""
    watched_class, entry = type(param), param.__dict__.pop(WATCHED_KEY, None)
    param.__class__ = watched_class.__mro__[2]  # (GradWatched<Own>, _GradWatched, <Own>, ...)
    try:
        yield
    finally:
        param.__class__ = watched_class
        if entry is not None:
            param.__dict__[WATCHED_KEY] = entry


_WATCHED_CLASSES: dict[type, type] = {}


def _watched_class(own: type) -> type:
    if own not in _WATCHED_CLASSES:
        _WATCHED_CLASSES[own] = type(f"GradWatched{own.__name__}", (_GradWatched, own), {})
    return _WATCHED_CLASSES[own]


def is_checked(param: object) -> bool:
    return isinstance(param, _GradWatched)


def watch(flats: list[Any], only_replaying: bool = False) -> None:
    """Reads of ``.grad`` of the parameters of ``flats`` that keep their full values (stages 1/2) are answered by
    the engine, and changes made in place to them replayed on the masters where that is needed to be exact, until
    :func:`unwatch` (idempotent). ``only_replaying``: only the FlatParams whose changes are replayed (stage 3's
    too: inside ``gathered_parameters()``, where its parameters are whole and their own class)."""
    for flat in flats:
        if not (replays_writes(flat) if only_replaying else flat.keeps_full):
            continue
        for param in flat.params:
            # a tensor-parallel parameter keeps its class: a DTensor's dispatch is its class's (see flat_param.py)
            if isinstance(param, _GradWatched) or is_distributed(param):
                continue
            param.__dict__[WATCHED_KEY] = weakref.ref(flat)
            param.__class__ = _watched_class(type(param))


@contextmanager
def replaying_writes(flats: list[Any]) -> Iterator[None]:
    """For the block, changes made in place to the whole parameters of ``flats`` that need it are replayed on their
    masters (see core/flat/exact_writes.py); stage 3's ``gathered_parameters()``."""
    watch(flats, only_replaying=True)
    try:
        yield
    finally:
        unwatch(flats)


def watch_whole(flats: list[Any]) -> None:
    """Reads of ``.grad`` of the parameters of ``flats`` are answered by the engine whatever their stage: stage 3's
    root unit, whole (and its parameters their own class) from the step's entry to the model's first computation
    (see [Note: reads until the model computes] in core/engine/first_use.py); until :func:`unwatch`."""
    for flat in flats:
        for param in flat.params:
            if not isinstance(param, _GradWatched) and not is_distributed(param):
                param.__dict__[WATCHED_KEY] = weakref.ref(flat)
                param.__class__ = _watched_class(type(param))


def unwatch(flats: list[Any]) -> None:
    """The parameters of ``flats`` take their own class back (idempotent)."""
    for flat in flats:
        for param in flat.params:
            unwatch_param(param)


def unwatch_param(param: Any) -> None:
    """``param`` takes its own class back, if it was watched."""
    if isinstance(param, _GradWatched):
        param.__class__ = type(param).__mro__[2]
        param.__dict__.pop(WATCHED_KEY, None)


def torch_grad(param: Tensor) -> Tensor | None:
    """Torch's own ``.grad`` attribute, whatever class the parameter has now."""
    with torch._C.DisableTorchFunctionSubclass():
        return param.grad
