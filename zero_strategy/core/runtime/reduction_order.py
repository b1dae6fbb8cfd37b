"""The one order in which every rank starts its units' gradient reductions during backward.

See [Note: collective order] in backward_reductions.py for why the order must be agreed rather than follow
each rank's own backward.
"""

from __future__ import annotations

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.runtime.unit import ZeroUnit


class ReductionOrder:
    """Decides when a unit whose gradients are all ready may start its reduction, so that every rank issues the
    same reductions in the same sequence whichever units it used.

    A ready unit starts only once every unit before it in the agreed order has started; whatever has not started by
    the end of backward starts then, continuing the agreed order and then the units outside it in unit order. Every
    rank therefore issues ``agreed + others`` in that sequence, some during backward and some at its end.

    Until the first backward has run, the order is the units' reversed module order (known to every rank without
    communication, and usually the order backward reaches them, so the first backward overlaps and holds few
    gradients too). At the end of the first backward rank 0's actual readiness order is broadcast and replaces it.
    """

    def __init__(self, units: list[ZeroUnit], comm: Comm) -> None:
        """``comm``: every rank of the run (the replicas' shard groups reduce in the same order)."""
        self.units = units
        self.comm = comm
        self.agreed: list[ZeroUnit] = list(reversed(units))
        self.measured = False  # whether `agreed` is rank 0's measured order yet
        self._recorded: list[ZeroUnit] = []  # this rank's readiness order in the first backward
        self._ready: set[int] = set()  # ids of units whose gradients all landed in this backward
        self._next = 0  # position in `agreed` of the first unit not yet started in this backward

    def on_ready(self, unit: ZeroUnit) -> list[ZeroUnit]:
        """``unit``'s last gradient landed: the units that may start their reductions now, in order."""
        if not self.measured and unit not in self._recorded:
            self._recorded.append(unit)
        self._ready.add(id(unit))
        starting: list[ZeroUnit] = []
        while self._next < len(self.agreed) and id(self.agreed[self._next]) in self._ready:
            starting.append(self.agreed[self._next])
            self._next += 1
        return starting

    def end_of_backward(self) -> list[ZeroUnit]:
        """The units not yet started in this backward, in the sequence every rank follows; the per-backward
        bookkeeping starts over."""
        in_order = {id(unit) for unit in self.agreed}
        remaining = self.agreed[self._next :] + [unit for unit in self.units if id(unit) not in in_order]
        self._ready.clear()
        self._next = 0
        return remaining

    def settle(self) -> None:
        """Collective after the first backward's reductions were all issued (so the broadcast has the same place
        in every rank's sequence of collectives): rank 0's measured order replaces the guess."""
        if self.measured:
            return
        mine = [self.units.index(unit) for unit in self._recorded]
        agreed = self.comm.broadcast_object(mine, 0, "agreement on the reduction order")
        self.agreed = [self.units[i] for i in agreed]
        self.measured = True
        self._recorded = []
