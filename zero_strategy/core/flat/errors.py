"""The error of a stage-3 parameter used outside forward where no answer can be DDP's, and the marker that tells
such a parameter from any other tensor (core/flat/access.py's class swap sets it)."""

from __future__ import annotations


class ShardedParameterError(RuntimeError):
    """A stage-3 parameter was used outside forward in a way ZeRO cannot answer as DDP would (where its values
    are, ``.data``, a write through a copy, a read or change only some ranks make)."""


SHARDED_MARKER = "_zero_sharded"
"""A class attribute, True on the class a stage-3 parameter takes while its values are on other ranks."""


def is_sharded(value: object) -> bool:
    """Whether ``value`` is a stage-3 parameter whose values are on other ranks now."""
    return bool(getattr(type(value), SHARDED_MARKER, False))
