"""Reads of ``p.grad`` where ZeRO keeps a parameter's gradient elsewhere: the value torch left there, and a warning
naming the parameter and what to use instead.

[Note: reading p.grad under ZeRO]
Under DDP, after the backward that synchronizes (every backward without accumulation, the last micro-batch of each
window with it), every rank's ``p.grad`` holds the gradient averaged over the ranks, and it stays there through
``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping`` and the step, until
``zero_grad()``. ZeRO moves it:

- stage 1 in fp32: ``p.grad`` holds *this rank's own* gradient, summed over the micro-batches and not averaged,
  from backward until the optimizer step's reduction moves it into the master slices. ``on_after_backward`` reads
  it there: DDP's equals it at the micro-batches that do not synchronize and is the average at the one that does.
  ``on_before_optimizer_step`` and ``configure_gradient_clipping`` run after the reduction: None there.
- stage 1 in bf16/fp16: None once backward produced it (each gradient goes into an fp32 accumulation buffer).
- stages 2 and 3: None after each backward (reduce-scattered into the slices as backward goes).

Keeping a full averaged ``p.grad`` would cost an all-reduce (twice stage 1's traffic) or a gather of the reduced
slices: the memory and traffic ZeRO exists to save. So the values stay what torch left there, and a read that
returns None (or a rank's own sum) where DDP's holds the average raises a :class:`ShardedGradientWarning`, once
per place in the code, naming the parameter and what to use instead: ``zero_strategy.grad_norm(module, norm_type)``
(per-parameter norms and their total, equal to DDP's at the points where DDP's gradients are synchronized; every
rank calls it), Lightning's clipping (``gradient_clip_val``, ``self.clip_gradients``: the global norm). Where
the read is seen:

- stage 3, anywhere outside forward/backward: the parameter has its sharded class there (see [Note: parameters
  outside forward] in access.py), which sees every read of ``.grad``;
- stages 1/2, during Lightning's gradient hooks (``on_after_backward``, ``on_before_optimizer_step``,
  ``configure_gradient_clipping``, the callbacks' too): the precision plugin gives the parameters a class that sees
  reads of ``.grad`` (:func:`watching`) for the hooks' duration only, so forward and backward never pay for it.

A read that finds no gradient because there is none (nothing since ``zero_grad()``) says nothing: DDP's is None
there too. ZeRO's own reads (``access.own_grad``) never warn, nor does ``nn.Module.zero_grad()``, which reads
``.grad`` only to clear it (Lightning calls it at the start of every fit, validation and test).
"""

from __future__ import annotations

import copy
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
from torch import nn

from zero_strategy.core.once import first_time

WATCHED_KEY = "_zero_grad_reads"  # a watched parameter's (weak reference to its FlatParam, its name)


class ShardedGradientWarning(UserWarning):
    """``p.grad`` was read where ZeRO keeps the gradient elsewhere (see [Note: reading p.grad under ZeRO])."""


class ModuleGrad(Enum):
    """What a parameter's ``.grad`` holds, against DDP's."""

    NONE = auto()  # no gradient since it was last cleared: None, as under DDP
    OWN = auto()  # this rank's own accumulated gradient, not averaged over the ranks
    ELSEWHERE = auto()  # averaged into the master slices (or the fp32 stash): None where DDP's holds it


_ADVICE = (
    "For per-parameter gradient norms equal to DDP's use zero_strategy.grad_norm(module, norm_type) (every rank "
    "calls it); for clipping use Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, ...), which "
    "clip by the global norm. See the README's 'Gradients under ZeRO'."
)


def is_grad_getter(func: Any) -> bool:
    """Whether ``__torch_function__`` was called for a read of ``.grad``."""
    owner = getattr(func, "__self__", None)
    return getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") == "grad"


def check_grad_read(param: Any, owner: Any, name: str) -> None:
    """``param.grad`` was read by code outside ZeRO; ``owner``: its FlatParam (None once the engine is gone)."""
    if owner is None:
        return
    index = next(i for i, candidate in enumerate(owner.params) if candidate is param)
    kind = owner.grads.module_grad(index)
    if kind is ModuleGrad.NONE:
        return
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("zero_strategy.core.flat"):
        frame = frame.f_back
    if frame.f_code is nn.Module.zero_grad.__code__:  # reads only to clear it
        return
    site = (frame.f_code.co_filename, frame.f_lineno, kind)
    if not first_time(("grad read", site)):  # once per line of the user's code (see [Note: once per process])
        return
    if kind is ModuleGrad.ELSEWHERE:
        message = (
            f"ZeRO: {name}.grad is None here, but its gradient exists: it was averaged over the ranks into the "
            "optimizer's sharded master slices (stages 2/3 after each backward, stage 1 at the optimizer step, "
            "stage 1 in bf16/fp16 as backward produces it), so no rank holds it whole. "
        )
    else:
        message = (
            f"ZeRO stage 1: {name}.grad holds this rank's own gradient, summed over the micro-batches but not "
            "averaged over the ranks: DDP's is the average after the micro-batch that synchronizes, and the "
            "optimizer step will use the average. "
        )
    module = frame.f_globals.get("__name__", "")
    warnings.warn_explicit(message + _ADVICE, ShardedGradientWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=module)


class _GradWatched:
    """Mixed in before a stage-1/2 parameter's own class while :func:`watching` runs: every operation goes through
    unchanged (and returns plain tensors), reads of ``.grad`` are checked."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            value = func(*args, **(kwargs or {}))
        watched = args[0].__dict__.get(WATCHED_KEY) if is_grad_getter(func) else None
        if watched is not None:
            owner, name = watched
            check_grad_read(args[0], owner(), name)
        return value

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy made during the hooks (an EMA callback) is a parameter of the parameter's own class."""
        with _as_own(self):
            return copy.deepcopy(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        with _as_own(self):
            return self.__reduce_ex__(protocol)


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


@contextmanager
def watching(flats: list[Any]) -> Iterator[None]:
    """For the block's duration, reads of ``.grad`` of the parameters of ``flats`` that keep their full values
    (stages 1/2; stage 3's sharded class checks its own) are checked (see [Note: reading p.grad under ZeRO])."""
    swapped: list[tuple[nn.Parameter, type]] = []
    for flat in flats:
        if not flat.keeps_full:
            continue
        for name, param in zip(flat.names, flat.params, strict=True):
            if isinstance(param, _GradWatched):
                continue
            own = type(param)
            param.__dict__[WATCHED_KEY] = (weakref.ref(flat), name)
            param.__class__ = _watched_class(own)
            swapped.append((param, own))
    try:
        yield
    finally:
        for param, own in swapped:
            param.__class__ = own
            param.__dict__.pop(WATCHED_KEY, None)
