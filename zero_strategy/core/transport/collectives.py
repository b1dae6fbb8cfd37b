"""Stateless collectives: each takes its process group as an argument and records what it moved.

Byte counts are the size of the full (unsharded) buffer a collective moves, the convention of NCCL's own
tests; a ring implementation puts (N-1)/N of that on each rank's wire.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from zero_strategy.core.transport import point_to_point as point_to_point_exchange

ProcessGroup = dist.ProcessGroup | None

# gloo emits a FutureWarning for reduce_scatter_tensor / all_gather_into_tensor in torch 2.13; it is about a
# future API change, not about our use, and a `-W error` run must not fail on it.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


@dataclass(slots=True)
class CommunicationLog:
    """Bytes and calls per collective kind, accumulated since the last :meth:`reset`."""

    bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds_by_kind: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Time this rank was blocked in collectives of each kind: communication *not* hidden behind compute (on a
    GPU, where NCCL runs on its own stream, this is the host-side time only)."""

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes_by_kind[kind] += nbytes
        self.calls_by_kind[kind] += 1

    @contextmanager
    def blocking(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds_by_kind[kind] += time.perf_counter() - start

    def reset(self) -> None:
        self.bytes_by_kind.clear()
        self.calls_by_kind.clear()
        self.seconds_by_kind.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes_by_kind)


class Waitable(Protocol):
    def wait(self) -> bool: ...


def prefers_point_to_point(group: ProcessGroup) -> bool:
    """Whether all-gather and reduce-scatter should run as point-to-point exchanges on this group's backend:
    on gloo they are about twice as fast as its own collectives (see [Note: why point-to-point on gloo])."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return str(dist.get_backend(group)) == "gloo"


class PendingGather(NamedTuple):
    """An all-gather started asynchronously; ``wait()`` before reading ``output``."""

    work: Waitable | None
    output: Tensor
    log: CommunicationLog | None = None

    def wait(self) -> Tensor:
        if self.work is not None:
            if self.log is None:
                self.work.wait()
            else:
                with self.log.blocking("all_gather"):  # only what prefetching did not hide
                    self.work.wait()
        return self.output


def _world(group: ProcessGroup) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_gather_flat(
    output: Tensor,
    shard: Tensor,
    group: ProcessGroup,
    log: CommunicationLog,
    async_op: bool = False,
    point_to_point: bool = False,
    salt: int = 0,
) -> PendingGather:
    """Fill ``output`` (``world_size`` × ``shard``) with every rank's shard, in rank order (``salt``: see
    :func:`point_to_point.all_gather`)."""
    log.record("all_gather", output.numel() * output.element_size())
    if _world(group) == 1:
        output.copy_(shard)
        return PendingGather(None, output)
    work: Waitable | None
    with log.blocking("all_gather"):
        if point_to_point:
            work = point_to_point_exchange.all_gather(output, shard, group, salt)
            if not async_op:
                work.wait()
        else:
            work = dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)
    return PendingGather(work if async_op else None, output, log)


class PendingReduce:
    """A reduce-scatter started asynchronously; :meth:`wait` returns this rank's averaged slice.

    It holds the flattened input until then (the sends read from it)."""

    def __init__(self, work: Waitable | None, shard: Tensor, world: int, log: CommunicationLog) -> None:
        self._work = work
        self._shard = shard
        self._world = world
        self._log = log

    def watch(self, wrap: Callable[[Waitable], Waitable]) -> None:
        """Wait through ``wrap(work)`` instead (see [Note: diverging gathers] in gather_watch.py)."""
        if self._work is not None:
            self._work = wrap(self._work)

    def wait(self) -> Tensor:
        if self._work is not None:
            with self._log.blocking("reduce_scatter"):  # only what overlapping did not hide
                self._work.wait()
            self._work = None
            self._shard.div_(self._world)
        return self._shard


def start_reduce_scatter_mean(
    flat: Tensor, group: ProcessGroup, log: CommunicationLog, point_to_point: bool = False
) -> PendingReduce:
    """Start averaging ``flat`` over ranks; ``wait()`` gives this rank's equal-sized slice (a new tensor)."""
    world = _world(group)
    log.record("reduce_scatter", flat.numel() * flat.element_size())
    shard = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
    if world == 1:
        shard.copy_(flat)
        return PendingReduce(None, shard, world, log)
    work: Waitable | None
    with log.blocking("reduce_scatter"):
        if point_to_point:
            work = point_to_point_exchange.reduce_scatter_sum(shard, flat, group)
        else:
            work = dist.reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingReduce(work, shard, world, log)


def reduce_scatter_mean(
    flat: Tensor, group: ProcessGroup, log: CommunicationLog, point_to_point: bool = False
) -> Tensor:
    """Average ``flat`` over ranks and return this rank's equal-sized slice of the result (a new tensor)."""
    return start_reduce_scatter_mean(flat, group, log, point_to_point).wait()


def all_reduce_sum(tensor: Tensor, group: ProcessGroup, log: CommunicationLog) -> Tensor:
    """Sum ``tensor`` in place over ranks (scalars: norms, overflow flags)."""
    log.record("all_reduce", tensor.numel() * tensor.element_size())
    if _world(group) > 1:
        with log.blocking("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: Tensor, group: ProcessGroup, log: CommunicationLog) -> Tensor:
    """Element-wise maximum of ``tensor`` in place over ranks (flags: "did any rank use this parameter")."""
    log.record("all_reduce", tensor.numel() * tensor.element_size())
    if _world(group) > 1:
        with log.blocking("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast_flat(tensor: Tensor, src: int, group: ProcessGroup, log: CommunicationLog) -> Tensor:
    """Overwrite ``tensor`` in place with rank ``src``'s copy (``src`` is a global rank)."""
    log.record("broadcast", tensor.numel() * tensor.element_size())
    if _world(group) > 1:
        with log.blocking("broadcast"):
            dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object(obj: Any, src: int, group: ProcessGroup) -> Any:
    """Rank ``src``'s picklable object on every rank (small control data: paths, ids)."""
    if _world(group) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def all_gather_object(obj: Any, group: ProcessGroup) -> list[Any]:
    """Every rank's picklable object, in rank order (small control data: file sizes, success flags)."""
    if _world(group) == 1:
        return [obj]
    gathered: list[Any] = [None] * _world(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
