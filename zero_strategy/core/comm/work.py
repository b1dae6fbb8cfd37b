"""Work: the one handle every exchange of the comm room returns.

An exchange starts when a :class:`~zero_strategy.core.comm.comm.Comm` method returns; ``wait()`` blocks until its
result is there (or, on a GPU with side streams, makes the current stream wait for it) and returns the result
tensor. Transports differ in what waiting means — gloo works, counters in shared memory, a CUDA event, a watch that
turns a wait that can never end into an error — and each builds its ``Work`` from the function that does it; the
callers only ever see this class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

NOTHING = torch.empty(0)
"""The result of an exchange that produces no tensor (a barrier)."""


class Work:
    """A started exchange. ``wait()`` runs the transport's wait once, then returns the same result every time."""

    __slots__ = ("_result", "_wait")

    def __init__(self, wait: Callable[[], Tensor] | None = None, result: Tensor = NOTHING) -> None:
        """``wait``: blocks until the exchange is complete and returns its result; None: already complete."""
        self._wait = wait
        self._result = result

    @classmethod
    def done(cls, result: Tensor = NOTHING) -> Work:
        """An exchange that completed when it was started (one rank, a copy, a read in place)."""
        return cls(None, result)

    @property
    def completed(self) -> bool:
        """Whether ``wait()`` has run (the result is there)."""
        return self._wait is None

    def wait(self) -> Tensor:
        if self._wait is not None:
            wait, self._wait = self._wait, None  # dropped first: whatever its closure holds is released
            self._result = wait()
        return self._result

    def then(self, finish: Callable[[Tensor], Tensor]) -> Work:
        """A Work that waits for this one, then returns ``finish(result)`` (e.g. a division after a sum)."""
        return Work(lambda: finish(self.wait()))
