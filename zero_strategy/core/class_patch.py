"""Overriding one method of a single object by giving it a subclass, and undoing it.

Used where torch offers no hook and an instance attribute would leak: an LR scheduler's ``state_dict`` is its
``__dict__`` (so a patched ``step`` would land in every checkpoint), and Lightning's ``LightningOptimizer`` calls
the optimizer *class's* ``zero_grad``. The subclass keeps the original's name, module and qualified name, so
``isinstance`` checks, error messages and checkpoint manifests see the class the user chose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_PATCHED: dict[tuple[type, str], type] = {}  # (original class, method name) -> the subclass overriding it


def override_method(obj: Any, name: str, make_method: Callable[[Any], Callable[..., Any]]) -> None:
    """Give ``obj`` a subclass of its class whose ``name`` is ``make_method(original_class)``. Idempotent."""
    original = type(obj)
    if original in _PATCHED.values():
        return
    key = (original, name)
    if key not in _PATCHED:
        namespace = {
            name: make_method(original),
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
        }
        _PATCHED[key] = type(original.__name__, (original,), namespace)
    obj.__class__ = _PATCHED[key]


def restore_class(obj: Any) -> None:
    """Undo :func:`override_method` on ``obj`` (no-op if it was not patched)."""
    for (original, _), patched in _PATCHED.items():
        if type(obj) is patched:
            obj.__class__ = original
