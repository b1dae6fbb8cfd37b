"""The Comm interface: how one process group moves bytes. Callers hold a Comm and never ask which transport it is.

The implementations (one rank, the backend's own collectives, point-to-point exchanges, shared memory on one host)
and the decorators (CUDA side streams, the divergence watch) live beside this file; ``engine_comms.py`` picks them
once per group. Every method starts an exchange and returns one :class:`Work`; every implementation counts what it
moves where it moves it (see [Note: counting bytes where they move] in log.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from zero_strategy.core.comm.group import Group
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.comm.work import Work

OUTSIDE_FORWARD = " outside forward"
"""How the label of a gather for a stage-3 parameter used outside forward ends (core/flat/outside_forward.py): the
point-to-point transport gives such gathers a tag family of their own, the divergence watch names them."""


class DivergedGathersError(RuntimeError):
    """The ranks gathered different stage-3 units (or a parameter outside forward on some ranks only) and can never
    complete the exchanges they wait on (see [Note: diverging gathers] in watch.py)."""


class ReduceOp(Enum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"


def combine_in_rank_order(parts: list[Tensor], op: ReduceOp) -> Tensor:
    """Every rank's contribution combined into a new tensor, summing in rank order (the order every transport
    sums in, so that results are bit-identical between transports)."""
    if op is ReduceOp.MAX:
        return torch.stack(parts).amax(0)
    result = parts[0].clone()
    for part in parts[1:]:
        result.add_(part)
    if op is ReduceOp.MEAN:
        result.div_(len(parts))
    return result


class Comm(ABC):
    """One process group's exchanges. ``label`` names what is exchanged (a unit, "agreement on used parameters")
    for error messages and for the divergence watch."""

    def __init__(self, group: Group, log: CommunicationLog) -> None:
        self.group = group
        self.log = log

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    # ------------------------------------------------------------------------------------- bulk exchanges
    @abstractmethod
    def all_gather(self, output: Tensor, shard: Tensor, label: str) -> Work:
        """Fill ``output`` (``size`` × ``shard``) with every rank's ``shard`` in rank order; ``shard`` may be this
        rank's own chunk of ``output``. The result is ``output``."""

    @abstractmethod
    def reduce_scatter(self, flat: Tensor, label: str, out: Tensor | None = None) -> Work:
        """This rank's chunk (``flat.numel() / size`` elements) of the mean of every rank's ``flat``, summed in rank
        order on every rank (results do not depend on which rank computes them). ``out``: where to put it (else a
        new tensor). ``flat`` must not be touched until the Work was waited for."""

    def reduce_input(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer to flatten the next :meth:`reduce_scatter`'s input into (shared memory hands out the buffer
        its peers read, saving a copy; everyone else a new tensor)."""
        return torch.empty(numel, dtype=dtype, device=device)

    @property
    def reductions_in_flight(self) -> int | None:
        """How many reduce-scatters a caller may keep in flight before waiting for the oldest: each one holds its
        flattened input in private memory until it lands, so a backward overlapping its reductions keeps this
        bound (see [Note: overlapped reduction] in runtime/backward_reductions.py). None: no bound (the transport owns
        its buffers and waits inside when they are all in use)."""
        return 1

    # ------------------------------------------------------------------------------------ small exchanges
    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: ReduceOp, label: str) -> Work:
        """Reduce ``tensor`` in place over the ranks; every rank gets bit-identical values. The result is
        ``tensor``."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int, label: str) -> Work:
        """Overwrite ``tensor`` in place with group rank ``src``'s values. The result is ``tensor``."""

    @abstractmethod
    def barrier(self, label: str) -> Work:
        """Every rank of the group reached this point once waited for."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        """Group rank ``src``'s picklable object on every rank (small control data). Blocking."""

    @abstractmethod
    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        """Every rank's picklable object, in rank order (small control data). Blocking."""

    @property
    def pairing_by_label(self) -> Comm:
        """The Comm to make an exchange that only some ranks may post through (a stage-3 parameter changed outside
        forward): one whose exchange never pairs with a peer's exchange of another kind or label, so that a rank
        left alone waits (for the watch or the timeout) instead of mixing bytes. Most transports tag their
        exchanges; shared memory pairs by sequence, and hands out its network Comm."""
        return self

    # ----------------------------------------------------------------------------------------- lifecycle
    def verify_step(self) -> None:  # noqa: B027 (a hook most transports leave empty)
        """Collective, once per optimizer step: check what only this transport can (the divergence watch
        compares the units every rank gathered). Nothing for most."""

    def close(self) -> None:  # noqa: B027 (a hook most transports leave empty)
        """Release what this Comm holds (threads, mappings). Idempotent; afterwards exchanges still work, without
        what was released (the watch, shared memory): a released engine's save runs through its Comms."""
