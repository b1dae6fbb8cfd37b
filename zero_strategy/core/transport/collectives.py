"""Stateless collectives: each takes its process group as an argument and records what it moved.

Byte counts per kind are the size of the full (unsharded) buffer a collective moves, the convention of NCCL's own
tests; a ring implementation puts (N-1)/N of that on each rank's wire.

Byte counts per link (``bytes_by_link``: inside a node / across nodes, see topology.py) are what *leaves this rank*,
split by the node of the receiving rank. For point-to-point exchanges they are exact (each send has a destination);
for the backend's own collectives they are the same model (each peer receives its 1/N share; an all-reduce twice
that; a broadcast: the source sends the whole buffer to every peer).
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from zero_strategy.core.transport import point_to_point as point_to_point_exchange
from zero_strategy.core.transport.streams import CollectiveStreams
from zero_strategy.core.transport.topology import INTRA_NODE, Replicas, Topology

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
    bytes_by_link: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes this rank sent, by link ("intra_node" / "inter_node"): see the module docstring."""
    inter_node_bytes_by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """The ``inter_node`` part of ``bytes_by_link`` per collective kind (which exchanges cross nodes)."""
    topology: Topology | None = None  # None: every rank on one node
    device_timing: bool = False
    """On a GPU, also time how long the compute stream waited for each collective, with CUDA events (the host does
    not block there, so host time says nothing); the profiler turns this on and reads it through
    :meth:`settle_device_times`, off the hot path."""
    _members: dict[int, list[int]] = field(default_factory=dict)  # id(group) → its global ranks
    _device_intervals: list[tuple[str, Any, Any]] = field(default_factory=list)  # (kind, start, end) CUDA events

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes_by_kind[kind] += nbytes
        self.calls_by_kind[kind] += 1

    def record_sends(self, kind: str, group: ProcessGroup, bytes_per_peer: int, only_from: int | None = None) -> None:
        """This rank sends ``bytes_per_peer`` to every other rank of ``group`` (``only_from``: only if this rank
        is that global rank, as a broadcast's source)."""
        if not (dist.is_available() and dist.is_initialized()) or bytes_per_peer == 0:
            return
        members = self._members.get(id(group))
        if members is None:
            members = self._members[id(group)] = dist.get_process_group_ranks(group or dist.group.WORLD)
        me = dist.get_rank()
        if only_from is not None and only_from != me:
            return
        for peer in members:
            if peer != me:
                link = INTRA_NODE if self.topology is None else self.topology.link(me, peer)
                self.bytes_by_link[link] += bytes_per_peer
                if link != INTRA_NODE:
                    self.inter_node_bytes_by_kind[kind] += bytes_per_peer

    @contextmanager
    def blocking(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds_by_kind[kind] += time.perf_counter() - start

    def stream_timer(self, kind: str) -> Callable[[Any, Any], None] | None:
        """Where a stream wait reports its (start, end) events, or None when device timing is off."""
        if not self.device_timing:
            return None
        return lambda start, end: self._device_intervals.append((kind, start, end))

    def settle_device_times(self) -> None:
        """Add the recorded device waits to ``seconds_by_kind`` (waits for their events: call it when logging)."""
        intervals, self._device_intervals = self._device_intervals, []
        for kind, start, end in intervals:
            end.synchronize()
            self.seconds_by_kind[kind] += start.elapsed_time(end) / 1000.0

    def reset(self) -> None:
        self._device_intervals.clear()
        self.bytes_by_kind.clear()
        self.calls_by_kind.clear()
        self.seconds_by_kind.clear()
        self.bytes_by_link.clear()
        self.inter_node_bytes_by_kind.clear()

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


def collective_device(group: ProcessGroup) -> torch.device:
    """The device whose tensors ``group``'s backend accepts: this rank's CUDA device on NCCL, the CPU otherwise.

    [Note: collectives run on the group's device]
    NCCL refuses CPU tensors and gloo (in this package's use) CPU ones only, so every tensor handed to a collective
    lives here, whatever device the data came from: a norm of CPU-offloaded gradients, a flag on a rank holding no
    gradient, a bitmap built on the host. The one rule is this function; the collectives below move a tensor that
    is elsewhere (small ones: scalars, flags) or refuse it (flat buffers, which are built on the right device)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:  # a mixed "cpu:gloo,cuda:nccl" group takes CPU tensors too
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_device(tensor: Tensor, group: ProcessGroup, what: str) -> None:
    """Flat buffers live where the module computes: on a backend that cannot take them (gloo with a module on a
    GPU, NCCL with one on the CPU) say so before the backend fails with a less helpful message."""
    wanted = collective_device(group)
    if tensor.device.type != wanted.type:
        raise RuntimeError(
            f"ZeRO: the {what} buffer is on {tensor.device}, but the process group's backend "
            f"({dist.get_backend(group)}) needs {wanted} tensors: train on GPUs with NCCL and on CPUs with gloo "
            "(see [Note: collectives run on the group's device])."
        )


@contextmanager
def on_collective_device(tensor: Tensor, group: ProcessGroup) -> Iterator[Tensor]:
    """``tensor`` itself when it is on ``group``'s device, else a copy there whose values are written back on exit
    (small tensors only: norms, flags, bitmaps)."""
    device = collective_device(group)
    if tensor.device == device:
        yield tensor
        return
    moved = tensor.to(device)
    yield moved
    tensor.copy_(moved)


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
    streams: CollectiveStreams | None = None,
) -> PendingGather:
    """Fill ``output`` (``world_size`` × ``shard``) with every rank's shard, in rank order (``salt``: see
    :func:`point_to_point.all_gather`). With ``streams`` on a GPU the gather runs on the gather stream and
    ``wait()`` orders the current stream after it (see [Note: streams for gathers and reductions])."""
    log.record("all_gather", output.numel() * output.element_size())
    log.record_sends("all_gather", group, shard.numel() * shard.element_size())
    if _world(group) == 1:
        output.copy_(shard)
        return PendingGather(None, output)
    _check_device(output, group, "all-gather output")
    if streams is not None and streams.enabled and output.is_cuda:
        issue = partial(_issue_gather, output, shard, group, point_to_point, salt)
        ready = streams.ready("gather", issue, (output, shard), log.stream_timer("all_gather"))
        return PendingGather(ready, output, None)
    work: Waitable | None
    with log.blocking("all_gather"):
        if point_to_point:
            work = point_to_point_exchange.all_gather(output, shard, group, salt)
            if not async_op:
                work.wait()
        else:
            work = dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)
    return PendingGather(work if async_op else None, output, log)


def _issue_gather(output: Tensor, shard: Tensor, group: ProcessGroup, point_to_point: bool, salt: int) -> None:
    """Start the gather and make the current (side) stream wait for it: NCCL's ``wait`` blocks a stream, not the
    host."""
    if point_to_point:
        point_to_point_exchange.all_gather(output, shard, group, salt).wait()
    else:
        _expect_work(dist.all_gather_into_tensor(output, shard, group=group, async_op=True)).wait()


def _issue_reduce(shard: Tensor, flat: Tensor, group: ProcessGroup, point_to_point: bool) -> None:
    if point_to_point:
        point_to_point_exchange.reduce_scatter_sum(shard, flat, group).wait()
    else:
        _expect_work(dist.reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)).wait()


def _expect_work(work: Any) -> Waitable:
    assert work is not None, "async_op=True returns a Work"
    return work  # type: ignore[no-any-return]


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
    flat: Tensor,
    group: ProcessGroup,
    log: CommunicationLog,
    point_to_point: bool = False,
    streams: CollectiveStreams | None = None,
) -> PendingReduce:
    """Start averaging ``flat`` over ranks; ``wait()`` gives this rank's equal-sized slice (a new tensor)."""
    world = _world(group)
    log.record("reduce_scatter", flat.numel() * flat.element_size())
    log.record_sends("reduce_scatter", group, flat.numel() * flat.element_size() // world)
    shard = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
    if world == 1:
        shard.copy_(flat)
        return PendingReduce(None, shard, world, log)
    _check_device(flat, group, "reduce-scatter input")
    if streams is not None and streams.enabled and flat.is_cuda:
        issue = partial(_issue_reduce, shard, flat, group, point_to_point)
        ready = streams.ready("reduce", issue, (flat, shard), log.stream_timer("reduce_scatter"))
        return PendingReduce(ready, shard, world, log)
    work: Waitable | None
    with log.blocking("reduce_scatter"):
        if point_to_point:
            work = point_to_point_exchange.reduce_scatter_sum(shard, flat, group)
        else:
            work = dist.reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingReduce(work, shard, world, log)


def all_reduce_mean_over_replicas(
    tensor: Tensor, replicas: Replicas, log: CommunicationLog, point_to_point: bool = False
) -> Tensor:
    """Average ``tensor`` in place over the replica group. Point-to-point: a reduce-scatter then an all-gather of
    the padded tensor, so every replica ends with bit-identical values (the sum runs in rank order everywhere) and
    the bytes per link are exact; otherwise the backend's all-reduce."""
    count, group = replicas.count, replicas.group
    log.record("replica_all_reduce", tensor.numel() * tensor.element_size())
    with log.blocking("replica_all_reduce"):
        if not point_to_point:
            log.record_sends("replica_all_reduce", group, 2 * tensor.numel() * tensor.element_size() // count)
            _check_device(tensor, group, "replica all-reduce")
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        else:
            chunk = -(-tensor.numel() // count)
            padded = torch.zeros(chunk * count, dtype=tensor.dtype, device=tensor.device)
            padded[: tensor.numel()].copy_(tensor)
            mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
            log.record_sends("replica_all_reduce", group, 2 * chunk * tensor.element_size())
            point_to_point_exchange.reduce_scatter_sum(mine, padded, group).wait()
            point_to_point_exchange.all_gather(padded, mine, group).wait()
            tensor.copy_(padded[: tensor.numel()])
        tensor.div_(count)
    return tensor


def reduce_scatter_mean(
    flat: Tensor, group: ProcessGroup, log: CommunicationLog, point_to_point: bool = False
) -> Tensor:
    """Average ``flat`` over ranks and return this rank's equal-sized slice of the result (a new tensor)."""
    return start_reduce_scatter_mean(flat, group, log, point_to_point).wait()


def all_reduce_sum(tensor: Tensor, group: ProcessGroup, log: CommunicationLog) -> Tensor:
    """Sum ``tensor`` in place over ranks (scalars: norms, overflow flags)."""
    return _all_reduce(tensor, group, log, dist.ReduceOp.SUM)


def all_reduce_max(tensor: Tensor, group: ProcessGroup, log: CommunicationLog) -> Tensor:
    """Element-wise maximum of ``tensor`` in place over ranks (flags: "did any rank use this parameter")."""
    return _all_reduce(tensor, group, log, dist.ReduceOp.MAX)


def _all_reduce(tensor: Tensor, group: ProcessGroup, log: CommunicationLog, op: Any) -> Tensor:
    log.record("all_reduce", tensor.numel() * tensor.element_size())
    log.record_sends("all_reduce", group, 2 * tensor.numel() * tensor.element_size() // _world(group))
    if _world(group) > 1:
        with log.blocking("all_reduce"), on_collective_device(tensor, group) as moved:
            dist.all_reduce(moved, op=op, group=group)
    return tensor


def broadcast_flat(tensor: Tensor, src: int, group: ProcessGroup, log: CommunicationLog) -> Tensor:
    """Overwrite ``tensor`` in place with rank ``src``'s copy (``src`` is a global rank)."""
    log.record("broadcast", tensor.numel() * tensor.element_size())
    log.record_sends("broadcast", group, tensor.numel() * tensor.element_size(), only_from=src)
    if _world(group) > 1:
        with log.blocking("broadcast"), on_collective_device(tensor, group) as moved:
            dist.broadcast(moved, src=src, group=group)
    return tensor


def barrier(group: ProcessGroup = None) -> None:
    """Every rank of ``group`` reaches this point. NCCL is told this rank's device: without ``device_ids`` it
    guesses one from the rank number, which is wrong when each rank sees one GPU (SLURM) or ranks do not map to
    devices in order, and it warns or hangs."""
    if _world(group) == 1:
        return
    device = collective_device(group)
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


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
