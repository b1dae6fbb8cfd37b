"""What the library does once per process (a warning, an ``atexit`` registration), remembered in one registry.

[Note: once per process]
A warning that would repeat at every step or every engine (a shared-memory fallback, a read of ``p.grad`` at one
line of the user's code, an untested torch) is said the first time only. Every such "first time?" question goes
through :func:`first_time`, never through a set of a module's own, so that one call, :func:`forget_all`, makes the
process new again: the multi-process test harness (zero_strategy/testing.py) calls it in each forked rank, which
would otherwise inherit what its parent already said and pass a "warns" or "does not warn" assertion without
testing anything. Python's own once-per-location registries are the harness's to reset too (see testing.py).
"""

from __future__ import annotations

from collections.abc import Hashable

_SEEN: set[Hashable] = set()


def first_time(key: Hashable) -> bool:
    """True the first time ``key`` is asked about in this process (since the last :func:`forget_all`)."""
    if key in _SEEN:
        return False
    _SEEN.add(key)
    return True


def forget_all() -> None:
    """Forget every key: each once-per-process action happens again (for a fresh test process)."""
    _SEEN.clear()
