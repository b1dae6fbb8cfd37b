"""The engine's hooks on a user's modules and parameters: safe to deep-copy, and never what keeps an engine alive.

A deep copy of a module (an EMA or SWA model, ``torch.optim.swa_utils.AveragedModel``, Lightning's
``StochasticWeightAveraging``) copies its hook dictionaries too. Copied as such, the engine's hooks would drag the
whole engine into the copy (its units, buffers, shared-memory mappings, threads) or make the copy drive this
engine's gathers. A copy of an :class:`OwnedHook` is an inert hook instead: the copy is a plain module with its own
full parameters (stage 3's parameters gather for the copy: see [Note: parameters outside forward] in
core/flat/access.py).

A hook on a parameter (``register_post_accumulate_grad_hook``) is held by torch's C++ side, which the garbage
collector cannot see through: a hook that referred to the engine strongly would make the engine, the model and the
engine's threads (the divergence watch) live for the rest of the process once the user drops them without a
release. :class:`ParameterHook` therefore holds its method's owner weakly.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a copied module's engine hook does: nothing."""


class OwnedHook(functools.partial):  # type: ignore[type-arg]
    """A hook of the engine's, registered on a user's module (see the module docstring): ``OwnedHook(method,
    *args)`` calls ``method(*args, *hook_args)``. A ``functools.partial`` because dynamo calls a partial of a
    ``torch.compiler.disable``d method without a graph break (a compiled block's ``_call_impl`` runs its hooks),
    where an object with a ``__call__`` of its own broke the graph at every hook."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert


class ParameterHook:
    """``method(*args, *hook_args)`` while the method's owner lives, nothing after (see the module docstring)."""

    def __init__(self, method: Callable[..., Any], *args: Any) -> None:
        self._method = weakref.WeakMethod(method)  # type: ignore[arg-type]
        self._args = args

    def __call__(self, *hook_args: Any) -> Any:
        method = self._method()
        return None if method is None else method(*self._args, *hook_args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert  # a copied parameter's hook must not drive this engine (see the module docstring)
