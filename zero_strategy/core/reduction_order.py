"""The one order in which every rank starts its units' gradient reductions during backward.

See [Note: collective order] in hooks.py for why the order must be agreed rather than follow each rank's own
backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zero_strategy.core.collectives import ProcessGroup, broadcast_object
from zero_strategy.core.unit import ZeroUnit


class ReductionOrder:
    """Decides when a unit whose gradients are all ready may start its reduction, so that every rank issues the
    same reductions in the same sequence whichever units it used.

    Until the order is agreed (the first backward) nothing starts during backward: every unit is reduced at the end
    of backward, in unit order. At the end of the first backward rank 0's readiness order is broadcast and becomes
    the agreed order. From then on a ready unit starts only once every unit before it in the agreed order has
    started; whatever has not started by the end of backward starts then, continuing the agreed order and then the
    units outside it in unit order. Every rank therefore issues ``agreed + others`` in that sequence, some during
    backward and some at its end.
    """

    def __init__(
        self,
        units: list[ZeroUnit],
        group: ProcessGroup,
        src_rank: int,
        run_collective: Callable[[str, Callable[[], Any]], Any] | None = None,
    ) -> None:
        """``run_collective(what, fn)``: how to run the one broadcast (the engine watches it at stage 3)."""
        self.run_collective = run_collective or (lambda what, fn: fn())
        self.units = units
        self.group = group
        self.src_rank = src_rank
        self.agreed: list[ZeroUnit] | None = None
        self._recorded: list[ZeroUnit] = []  # this rank's readiness order in the first backward
        self._ready: set[int] = set()  # ids of units whose gradients all landed in this backward
        self._next = 0  # position in `agreed` of the first unit not yet started in this backward

    def on_ready(self, unit: ZeroUnit) -> list[ZeroUnit]:
        """``unit``'s last gradient landed: the units that may start their reductions now, in order."""
        if self.agreed is None:
            if unit not in self._recorded:
                self._recorded.append(unit)
            return []
        self._ready.add(id(unit))
        starting: list[ZeroUnit] = []
        while self._next < len(self.agreed) and id(self.agreed[self._next]) in self._ready:
            starting.append(self.agreed[self._next])
            self._next += 1
        return starting

    def end_of_backward(self) -> list[ZeroUnit]:
        """Collective the first time (agrees the order). The units not yet started in this backward, in the
        sequence every rank follows; the per-backward bookkeeping starts over."""
        if self.agreed is None:
            mine = [self.units.index(unit) for unit in self._recorded]
            agreed = self.run_collective(
                "agreement on the reduction order", lambda: broadcast_object(mine, self.src_rank, self.group)
            )
            self.agreed = [self.units[i] for i in agreed]
            self._recorded = []
            started = 0
        else:
            started = self._next
        in_order = {id(unit) for unit in self.agreed}
        remaining = self.agreed[started:] + [unit for unit in self.units if id(unit) not in in_order]
        self._ready.clear()
        self._next = 0
        return remaining
