"""The engine's hooks on a user's objects (modules, parameters, tensors, optimizers): safe to deep-copy, and never
what keeps an engine alive.

A deep copy of a module (an EMA or SWA model, ``torch.optim.swa_utils.AveragedModel``, Lightning's
``StochasticWeightAveraging``) copies its hook dictionaries too. Copied as such, the engine's hooks would drag the
whole engine into the copy (its units, buffers, shared-memory mappings, threads) or make the copy drive this
engine's gathers. A copy of an :class:`OwnedHook` is an inert hook instead: the copy is a plain module with its own
full parameters (stage 3's parameters gather for the copy: see [Note: parameters outside forward] in
core/flat/access.py).

[Note: hooks hold the engine weakly]
A user keeps the model and drops the engine (a second fit builds a new one; a script replaces its wrapper): the
engine, its units' buffers, shared-memory mappings and threads (the divergence watch) must go with it, even without
a release. Every hook the engine puts on a user's object therefore holds the object whose method it calls (the
engine or one of the parts the engine owns: its runtime hooks, state-dict hooks, step windows) *weakly*; the
engine holds those parts strongly. A module's hook dictionary, a parameter's C++ hook list and an optimizer's
instance attribute are all held by the user, and a parameter's hooks live on torch's C++ side, which the garbage
collector cannot see through, so a strong hook there would keep the engine for the rest of the process. Once the
engine is gone its hooks do nothing (tests/distributed/test_engine_threads.py keeps the model and drops the engine
on both transports).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from zero_strategy.core.runtime.compile_check import not_traced


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a copied object's engine hook does: nothing."""


def _call_while_alive(owner: weakref.ref[Any], function: Callable[..., Any], *args: Any) -> Any:
    """``function(owner, *args)`` while ``owner`` lives, nothing after."""
    alive = owner()
    return None if alive is None else function(alive, *args)


# A hook whose method is ``not_traced`` is untraced as a whole: dynamo then breaks the graph at the hook's call, as it
# did when the hook was the method itself, instead of tracing the weak lookup and breaking inside it (one frame more
# to compile per hook; see [Note: torch.compile] in compile_check.py).
_call_while_alive_untraced = not_traced(_call_while_alive)


class OwnedHook(functools.partial):  # type: ignore[type-arg]
    """A hook of the engine's on a user's object (see the module docstring): ``OwnedHook(obj.method, *args)`` calls
    ``obj.method(*args, *hook_args)`` while ``obj`` lives and does nothing after; it holds ``obj`` weakly.

    A ``functools.partial`` because dynamo calls a partial of a ``torch.compiler.disable``d function without a
    graph break of its own (a compiled block's ``_call_impl`` runs its hooks), where an object with a ``__call__``
    of its own broke the graph at every hook."""

    def __new__(cls, method: Callable[..., Any], *args: Any) -> OwnedHook:
        owner = getattr(method, "__self__", None)
        function = getattr(method, "__func__", None)
        if owner is None or function is None:
            raise TypeError(f"OwnedHook takes a bound method (obj.method), got {method!r}")
        caller = _call_while_alive_untraced if getattr(function, "_torchdynamo_disable", False) else _call_while_alive
        return super().__new__(cls, caller, weakref.ref(owner), function, *args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert
