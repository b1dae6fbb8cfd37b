"""What the exchanges of one engine moved, counted by the transports where they move it.

[Note: counting bytes where they move]
Two kinds of figures, both recorded inside the comm room at the point of the exchange, never estimated by callers:
- ``bytes_by_kind`` / ``calls_by_kind``: per collective kind, the size of the whole (unsharded) buffer each
  exchange works on — the convention of NCCL's own tests, so figures compare across transports and with the
  communication plan of each stage (stage 1/2: Ψ reduce-scatter + Ψ all-gather per step; stage 3: + Ψ all-gather).
  An exchange that moves nothing (stage 3's parameters read in place from a host-wide buffer) records nothing.
- ``bytes_by_peer`` / ``bytes_by_link`` / ``inter_node_bytes_by_kind``: what actually left or reached this rank,
  per peer (global rank) and per link (inside a node / across nodes, by the launcher's topology): for
  point-to-point exchanges the bytes handed to each ``isend``; for shared memory the bytes this rank copied out of
  each peer's buffer (intra-host by construction); for the backend's own collectives (``collectives="native"``)
  the input handed to the collective, under the peer ``COLLECTIVE_PEER`` and the link ``"collective"``, because
  the backend alone decides which peer receives what.
``seconds_by_kind`` is the time this rank was blocked waiting (communication not hidden behind compute; on a GPU
the device-side waits are added by :meth:`settle_device_times`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from zero_strategy.core.plan.topology import INTER_NODE, INTRA_NODE, Topology

COLLECTIVE_LINK = "collective"
"""The link of bytes handed to a backend collective, whose routing the backend alone knows."""
COLLECTIVE_PEER = -1


@dataclass(slots=True)
class CommunicationLog:
    """Figures of one engine's exchanges since the last :meth:`reset` (see [Note: counting bytes where they
    move])."""

    topology: Topology | None = None  # None: every rank on one node
    prefix: str = ""  # put before every kind this log records (the replicas' exchanges: "replica_")
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds_by_kind: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes_by_peer: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    bytes_by_link: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inter_node_bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    device_timing: bool = False
    """On a GPU, also time how long the compute stream waited for each exchange, with CUDA events; the profiler
    turns this on and reads it through :meth:`settle_device_times`, off the hot path."""
    _device_intervals: list[tuple[str, Any, Any]] = field(default_factory=list)

    def prefixed(self, prefix: str) -> CommunicationLog:
        """A log writing into the same figures, under ``prefix + kind`` (a group whose exchanges are reported apart,
        e.g. hybrid sharding's replica average)."""
        return replace(self, prefix=prefix)

    def record_call(self, kind: str, buffer_bytes: int) -> None:
        """One exchange of ``kind`` working on a whole buffer of ``buffer_bytes``."""
        kind = self.prefix + kind
        self.bytes_by_kind[kind] += buffer_bytes
        self.calls_by_kind[kind] += 1

    def record_moved(self, kind: str, me: int, peer: int, nbytes: int) -> None:
        """``nbytes`` moved between global ranks ``me`` and ``peer`` (``COLLECTIVE_PEER``: handed to a backend
        collective)."""
        if nbytes == 0:
            return
        kind = self.prefix + kind
        self.bytes_by_peer[peer] += nbytes
        if peer == COLLECTIVE_PEER:
            link = COLLECTIVE_LINK
        else:
            link = INTRA_NODE if self.topology is None else self.topology.link(me, peer)
        self.bytes_by_link[link] += nbytes
        if link == INTER_NODE:
            self.inter_node_bytes_by_kind[kind] += nbytes

    @contextmanager
    def blocking(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds_by_kind[self.prefix + kind] += time.perf_counter() - start

    def stream_timer(self, kind: str) -> Callable[[Any, Any], None] | None:
        """Where a stream wait reports its (start, end) events, or None when device timing is off."""
        if not self.device_timing:
            return None
        kind = self.prefix + kind
        return lambda start, end: self._device_intervals.append((kind, start, end))

    def settle_device_times(self) -> None:
        """Add the recorded device waits to ``seconds_by_kind`` (waits for their events: call it when logging)."""
        intervals, self._device_intervals = self._device_intervals, []
        for kind, start, end in intervals:
            end.synchronize()
            self.seconds_by_kind[kind] += start.elapsed_time(end) / 1000.0

    def reset(self) -> None:
        self._device_intervals.clear()
        for figures in (self.bytes_by_kind, self.calls_by_kind, self.seconds_by_kind, self.bytes_by_peer,
                        self.bytes_by_link, self.inter_node_bytes_by_kind):
            figures.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes_by_kind)
