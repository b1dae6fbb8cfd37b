"""The engine's hooks on a user's modules, safe to deep-copy.

A deep copy of a module (an EMA or SWA model, ``torch.optim.swa_utils.AveragedModel``, Lightning's
``StochasticWeightAveraging``) copies its hook dictionaries too. Copied as such, the engine's hooks would drag the
whole engine into the copy (its units, buffers, shared-memory mappings, threads) or make the copy drive this
engine's gathers. A copy of an :class:`OwnedHook` is an inert hook instead: the copy is a plain module with its own
full parameters (stage 3's parameters gather for the copy: see [Note: parameters outside forward] in
core/flat/access.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a copied module's engine hook does: nothing."""


class OwnedHook:
    """A hook of the engine's, registered on a user's module (see the module docstring)."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self._hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert
