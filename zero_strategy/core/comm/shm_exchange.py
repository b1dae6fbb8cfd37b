"""The protocol behind exchanges between the CPU ranks of one host through shared memory: arenas and counters.

[Note: shared-memory reductions]
Through gloo, a reduce-scatter costs each rank a kernel copy of every byte it sends and receives on the TCP
loopback, plus gloo's I/O threads competing with the compute for the same cores. On one host the ranks can read each
other's gradients instead: every rank owns ``ARENAS`` (2) *arenas* in ``/dev/shm`` (each the size of the largest
flattened gradient) and two shared int64 counters only it writes, *posted* and *done*, and a reduction is

1. the FlatParam flattens its gradients straight into this rank's arena ``s % ARENAS`` for exchange ``s`` (no extra
   copy);
2. the rank sets its *posted* counter to ``s``;
3. once every rank's *posted* reached ``s``, it sums its own chunk of every rank's arena, in rank order (the same
   sums as the point-to-point path: the results are bit-identical to it), and sets its *done* counter to ``s``.

A rank reads (step 3) its exchanges in sequence order, and as early as it can: whenever it posts or asks for an
arena, it reads every exchange in flight that all ranks have posted, without waiting. Why the arenas are safe to
reuse: before a rank writes arena ``s % ARENAS`` again for exchange ``s``, it reads its own exchange
``s - ARENAS`` (the arena's last use) and waits until every peer's *done* reached ``s - ARENAS``
(:meth:`SharedExchange.next_buffer`); *done* only moves after a rank's reads. Why this pays: the slower rank finds
its faster peer's posts already there, reads at once and moves its *done* along, so the faster rank can post up to
``ARENAS`` exchanges ahead of it before it waits (one, when each exchange was read before the next was posted). A
stage 2/3 backward therefore does not meet its peers at every unit: small drifts between the ranks' backward
passes are absorbed, and the ranks wait for each other at the end of backward, where the last reductions are read
(see [Note: overlapped reduction] in runtime/backward_reductions.py).

Why spinning on a counter is sound here: it relies on the processor making a rank's plain stores visible to other
cores in program order (the gradient bytes before the counter) and its loads in order. x86-64 guarantees both
(total store order); Arm and others do not without fence instructions, which Python cannot issue, so there
reductions stay point-to-point (:func:`spin_sync_is_sound`). A wait that lasts longer than the process group's
timeout, or a peer process that exits, ends with :class:`SharedReductionError` naming the unit and the ranks that
did not arrive. The wait spins briefly, then yields its core, then sleeps in short naps, so that ranks sharing a
core (more ranks than cores) do not starve the peer they wait for.

The same counters carry the engine's other per-step exchanges between these ranks (shared_memory.py): the
agreement on used parameters and the gradient norm (small all-reduces) and, at stage 3, the two barriers of the
host-wide parameters' write rule. Each is one more sequence number, posted by every rank in the same order as the
reductions; a barrier first reads every exchange in flight.

The step-time effect: ``python -m benchmarks.benchmark --params 5m --methods
single_process,ddp,zero2,zero2_point_to_point`` (the ``*_point_to_point`` rows are the same stages without shared
memory); the README's benchmark table has the figures.

What stays point-to-point (comm/engine_comms.py decides): a FlatParam larger than ``ARENA_CAP_BYTES`` (the arenas would
cost ``ARENAS`` copies of it per rank for the whole run), stage 3 when its gathers go through the network (the
divergence watch of watch.py must see every wait), hybrid replicas' all-reduce, and every rank not on one host.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.host_segments import HostSegments
from zero_strategy.core.comm.log import CommunicationLog

ARENAS = 2
"""Arenas per rank: a rank can post up to ``ARENAS`` exchanges ahead of the slowest peer (more arenas, more slack,
at one largest flattened gradient of ``/dev/shm`` each)."""
_COUNTER_STRIDE = 8  # int64s per counter: each rank's counter on a cache line of its own
_SPINS = 200  # polls before the wait yields its core (a peer that is microseconds away)
_YIELD_S = 0.002  # then yields for this long before it starts to nap
_NAP_S = 50e-6
_LIVENESS_EVERY_S = 1.0


class SharedReductionError(RuntimeError):
    """A shared-memory reduction could not complete: a peer did not arrive in time or exited."""


def spin_sync_is_sound() -> bool:
    """Whether this processor orders plain stores and loads as the counter protocol needs (x86-64's total store
    order; see [Note: shared-memory reductions])."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedExchange:
    """This rank's arenas and counters, and its peers' mappings of theirs: the protocol of [Note: shared-memory
    reductions]. The exchanges themselves (what is written, what is read) are :class:`SharedMemoryComm`'s."""

    def __init__(self, network: Comm, arena_bytes: int, timeout_s: float, log: CommunicationLog) -> None:
        """``network``: the group's network Comm, for the set-up agreements. Collective."""
        self.rank = network.rank
        self.world_size = network.size
        self.arena_bytes = arena_bytes
        self.timeout_s = timeout_s
        self.log = log  # where waits for a slower peer's arena are logged
        self._network = network
        self._segments = HostSegments(network)
        self._counter_key = self._segments.allocate(_COUNTER_STRIDE, torch.int64)[1]
        self._arena_keys = [self._segments.allocate(arena_bytes, torch.uint8)[1] for _ in range(ARENAS)]
        self._posted: list[ctypes.c_int64] = []  # per rank: the last exchange it posted
        self._done: list[ctypes.c_int64] = []  # per rank: the last exchange it finished reading
        self._sequence = 0  # exchanges posted by this rank
        self._in_flight: deque[SharedExchangeOp] = deque()  # posted, not yet read; in sequence order
        self._peers: list[tuple[int, str | None]] = []  # every rank's (pid, start time), when visible here
        self.failure: str | None = None

    def connect(self) -> bool:
        """Collective: map every peer's arenas and counter (False on every rank when some rank cannot)."""
        connected = self._segments.connect()
        self.failure = self._segments.failure
        if connected:
            counters = self._segments.shards(self._counter_key)
            self._posted = [ctypes.c_int64.from_address(counter.data_ptr()) for counter in counters]
            self._done = [ctypes.c_int64.from_address(counter.data_ptr() + 8) for counter in counters]
            # (pid, start time): a peer in another PID namespace does not match, and then exits are not watched
            identities = self._network.all_gather_object((os.getpid(), _start_time(os.getpid())), "liveness")
            visible = all(start is not None and _start_time(pid) == start for pid, start in identities)
            self._peers = identities if visible else []
        return connected

    @property
    def posted(self) -> int:
        """Exchanges this rank has posted through shared memory since it was built."""
        return self._sequence

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.arena_bytes

    def next_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        """This rank's arena for its next exchange, as ``numel`` elements of ``dtype``, once it is free: every rank
        (this one included) finished reading the exchange that used it ``ARENAS`` sequence numbers ago (see [Note:
        shared-memory reductions])."""
        sequence = self._sequence + 1
        self._complete_arrived()
        reused = sequence - ARENAS
        while self._in_flight and self._in_flight[0].sequence <= reused:
            self._in_flight[0].complete()
        if reused > 0 and any(counter.value < reused for counter in self._done):
            with self.log.blocking("barrier"):  # waiting for a slower peer, as at a barrier
                self._wait(self._done, reused, f"release of the arena of exchange {reused}")
        return self._view(self._arena_keys[sequence % ARENAS], self.rank, numel, dtype)

    def _complete_arrived(self) -> None:
        """Read, in order, the exchanges in flight that every rank has posted (no waiting): a rank that reads
        early frees its peers' arenas early, so a faster peer can run up to ``ARENAS`` exchanges ahead."""
        while self._in_flight and all(counter.value >= self._in_flight[0].sequence for counter in self._posted):
            self._in_flight[0].complete()

    def _view(self, key: int, rank: int, numel: int, dtype: torch.dtype) -> Tensor:
        nbytes = numel * dtype.itemsize
        return self._segments.shards(key)[rank][:nbytes].view(dtype)

    def close(self) -> None:
        """Read what is still in flight and let go of the mappings (they are unmapped with their last view)."""
        self.read_all_in_flight()
        self._posted, self._done, self._segments = [], [], None  # type: ignore[assignment]

    def read_all_in_flight(self) -> None:
        """Read every exchange still in flight (a barrier's first step)."""
        while self._in_flight:
            self._in_flight[0].complete()

    def post(self, kind: str, what: str, finish: Callable[[int], Tensor]) -> SharedExchangeOp:
        """Post the next exchange (this rank's bytes for it are already in its arena); ``finish(sequence)`` reads
        what it needs from the ranks' arenas once every rank posted it."""
        self._sequence += 1
        operation = SharedExchangeOp(self, self._sequence, self.log, kind, what, finish)
        self._posted[self.rank].value = self._sequence  # after the bytes it publishes: see the Note
        self._in_flight.append(operation)
        self._complete_arrived()
        return operation

    def arenas(self, sequence: int, numel: int, dtype: torch.dtype) -> list[Tensor]:
        """Every rank's arena of exchange ``sequence``, as ``numel`` elements of ``dtype``, in rank order."""
        key = self._arena_keys[sequence % ARENAS]
        return [self._view(key, rank, numel, dtype) for rank in range(self.world_size)]

    def complete_in_order(self, operation: SharedExchangeOp) -> None:
        """Read every exchange posted before ``operation`` that is still in flight (reads happen in sequence
        order, which is what ``done`` promises)."""
        while self._in_flight and self._in_flight[0] is not operation:
            self._in_flight[0].complete()

    def completed(self, operation: SharedExchangeOp) -> None:
        """``operation``'s reads are finished: tell the peers (they may reuse its arenas)."""
        if self._in_flight and self._in_flight[0] is operation:
            self._in_flight.popleft()
        self._done[self.rank].value = operation.sequence  # after the reads: x86 keeps loads before later stores

    def wait_for_peers(self, sequence: int, what: str) -> None:
        """Spin, then yield, then nap until every rank posted ``sequence``."""
        self._wait(self._posted, sequence, what)

    def _wait(self, counters: list[ctypes.c_int64], sequence: int, what: str) -> None:
        """Spin, then yield, then nap until every rank's counter in ``counters`` reached ``sequence``."""
        for _ in range(_SPINS):
            if all(counter.value >= sequence for counter in counters):
                return
        start = time.monotonic()
        next_liveness = start + _LIVENESS_EVERY_S
        while not all(counter.value >= sequence for counter in counters):
            now = time.monotonic()
            if now - start < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(_NAP_S)
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                self._check_peers(counters, sequence, what, now - start)

    def _check_peers(self, counters: list[ctypes.c_int64], sequence: int, what: str, waited_s: float) -> None:
        missing = [rank for rank, counter in enumerate(counters) if counter.value < sequence]
        exited = [rank for rank in missing if self._peers and not _alive(*self._peers[rank])]
        if exited:
            raise SharedReductionError(
                f"rank {self.rank}: the shared-memory {what} waits for rank(s) {exited}, whose "
                "process exited; see that rank's error."
            )
        if waited_s > self.timeout_s:
            raise SharedReductionError(
                f"rank {self.rank}: rank(s) {missing} did not reach the shared-memory {what} "
                f"within process_group_timeout_s={self.timeout_s:g} s. Every rank must run the same backward passes "
                "and optimizer steps; if a rank is only slow, raise process_group_timeout_s."
            )


class SharedExchangeOp:
    """One exchange posted through shared memory; ``wait()`` returns its result (see the ``start_*`` methods)."""

    def __init__(
        self, exchange: SharedExchange, sequence: int, log: CommunicationLog, kind: str, what: str,
        finish: Callable[[int], Tensor],
    ) -> None:
        self._exchange = exchange
        self._sequence = sequence
        self._log = log
        self._kind = kind
        self._what = what
        self._finish = finish
        self._result: Tensor | None = None

    @property
    def sequence(self) -> int:
        return self._sequence

    def complete(self) -> None:
        """Wait until every rank posted this exchange, then read what it needs from their arenas (the exchanges
        posted before it first)."""
        if self._result is not None:
            return
        self._exchange.complete_in_order(self)
        with self._log.blocking(self._kind):
            self._exchange.wait_for_peers(self._sequence, self._what)
        self._result = self._finish(self._sequence)
        self._exchange.completed(self)

    def wait(self) -> Tensor:
        self.complete()
        assert self._result is not None
        return self._result


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the process name (which may contain spaces), or None without it."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot): with the pid, it names one process."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _alive(pid: int, started: str | None) -> bool:
    """Whether the process that had ``pid`` when it started at ``started`` is running: a zombie (exited, not yet
    reaped by its parent, e.g. a rank launched by rank 0 that waits here) counts as exited, and so does a new process
    that was given the same pid."""
    fields = _stat_fields(pid)
    return fields is not None and len(fields) > 19 and fields[19] == started and fields[0] not in ("Z", "X")
