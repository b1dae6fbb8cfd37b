"""A group of N ranks simulated inside one process, one thread per rank: the transport of logic tests.

Exchanges meet at a rendezvous of the simulated world: each rank posts its contribution under the exchange's key
(its kind, its number in that kind, and for gathers the label, like the point-to-point tags) and the Work collects
every rank's once they are all there. Sums run in rank order, as on every real transport, so results equal the
point-to-point path bit for bit. A rank that raises aborts the world: its peers' waits fail at once instead of
waiting for the timeout. No processes, sockets or process groups: FlatParam, unit and step logic run in
milliseconds (see ``zero_strategy.testing.run_in_process``; an engine built on a rank's thread without a group
finds its simulated group through ``group.simulated_group``, which only the engine's constructor reads).

What it cannot simulate: anything that needs real processes — shared memory between ranks, the divergence watch
(it uses the process group's store), per-process state such as the default random generator (threads share it, so
a model that draws random numbers in forward, like dropout, differs between runs).
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zero_strategy.core.comm.comm import Comm, ReduceOp, combine_in_rank_order
from zero_strategy.core.comm.group import Group
from zero_strategy.core.comm.work import Work

_GATHER, _OTHER = 0, 1


class InProcessWorld:
    """The rendezvous of N simulated ranks."""

    def __init__(self, size: int, timeout_s: float = 60.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._posts: dict[tuple[Any, ...], list[Any]] = {}
        self._arrived: dict[tuple[Any, ...], int] = {}
        self._collected: dict[tuple[Any, ...], int] = {}
        self.failure: str | None = None

    def group(self, rank: int, members: tuple[int, ...] | None = None) -> InProcessGroup:
        members = tuple(range(self.size)) if members is None else members
        return InProcessGroup(self, members.index(rank), members)

    def abort(self, why: str) -> None:
        with self._cond:
            self.failure = self.failure or why
            self._cond.notify_all()

    def post(self, key: tuple[Any, ...], rank: int, count: int, payload: Any) -> None:
        with self._cond:
            slots = self._posts.setdefault(key, [None] * count)
            slots[rank] = payload
            self._arrived[key] = self._arrived.get(key, 0) + 1
            self._cond.notify_all()

    def collect(self, key: tuple[Any, ...], count: int, what: str) -> list[Any]:
        """Every rank's payload of ``key``, once all ``count`` posted it (each rank collects once)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._arrived.get(key, 0) < count:
                if self.failure is not None:
                    raise RuntimeError(f"in-process rank failed ({self.failure}); {what} cannot complete")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"in-process {what}: only {self._arrived.get(key, 0)} of {count} ranks "
                                       f"posted it within {self.timeout_s:g} s (the ranks diverged?)")
                self._cond.wait(left)
            payloads = list(self._posts[key])
            self._collected[key] = self._collected.get(key, 0) + 1
            if self._collected[key] == count:  # everyone has its copy: forget it
                del self._posts[key], self._arrived[key], self._collected[key]
            return payloads


@dataclass(frozen=True, slots=True)
class InProcessGroup:
    """A (sub)group of simulated ranks; stands where a ``torch.distributed`` process group would."""

    world: InProcessWorld
    rank: int  # position in the group
    members: tuple[int, ...]  # world ranks

    def describe(self) -> Group:
        return Group(self, self.rank, len(self.members), self.members, torch.device("cpu"))


class InProcessComm(Comm):
    """Exchanges between the threads of one :class:`InProcessWorld` (see the module docstring)."""

    def __init__(self, group: Group, *args: Any, **kwargs: Any) -> None:
        super().__init__(group, *args, **kwargs)
        handle = group.handle
        assert isinstance(handle, InProcessGroup)
        self._world = handle.world
        self._issued = [0, 0]

    def _key(self, family: int, label: str = "") -> tuple[Any, ...]:
        number = self._issued[family]
        self._issued[family] += 1
        return (self.group.members, family, number, label if family == _GATHER else "")

    def _post(self, key: tuple[Any, ...], payload: Any) -> None:
        self._world.post(key, self.rank, self.size, payload)

    def _collect(self, key: tuple[Any, ...], kind: str, what: str, moved_each: int) -> list[Any]:
        with self.log.blocking(kind):
            payloads = self._world.collect(key, self.size, what)
        for peer in self.group.peers():
            self.log.record_moved(kind, self.group.me, self.group.global_rank(peer), moved_each)
        return payloads

    def all_gather(self, output: Tensor, shard: Tensor, label: str) -> Work:
        self.log.record_call("all_gather", output.numel() * output.element_size())
        key = self._key(_GATHER, label)
        self._post(key, shard.detach().clone())
        nbytes = shard.numel() * shard.element_size()

        def fill() -> Tensor:
            for chunk, part in zip(output.chunk(self.size), self._collect(key, "all_gather", f"all-gather of "
                                                                          f"{label!r}", nbytes), strict=True):
                if chunk.data_ptr() != part.data_ptr():
                    chunk.copy_(part)
            return output

        return Work(fill)

    def reduce_scatter(self, flat: Tensor, label: str, out: Tensor | None = None) -> Work:
        self.log.record_call("reduce_scatter", flat.numel() * flat.element_size())
        key = self._key(_OTHER)
        self._post(key, flat.detach().clone())
        chunk = flat.numel() // self.size

        def mean_of_own_chunk() -> Tensor:
            parts = self._collect(key, "reduce_scatter", f"reduce-scatter of {label!r}", chunk * flat.element_size())
            lo, hi = self.rank * chunk, (self.rank + 1) * chunk
            result = parts[0][lo:hi].clone() if out is None else out.copy_(parts[0][lo:hi])
            for part in parts[1:]:
                result.add_(part[lo:hi])
            return result.div_(self.size)

        return Work(mean_of_own_chunk)

    def all_reduce(self, tensor: Tensor, op: ReduceOp, label: str) -> Work:
        nbytes = tensor.numel() * tensor.element_size()
        self.log.record_call("all_reduce", nbytes)
        key = self._key(_OTHER)
        self._post(key, tensor.detach().clone())
        parts = self._collect(key, "all_reduce", f"all-reduce of {label}", nbytes)
        return Work.done(tensor.copy_(combine_in_rank_order(parts, op)))

    def broadcast(self, tensor: Tensor, src: int, label: str) -> Work:
        self.log.record_call("broadcast", tensor.numel() * tensor.element_size())
        key = self._key(_OTHER)
        self._post(key, tensor.detach().clone() if self.rank == src else None)
        source = self._collect(key, "broadcast", f"broadcast of {label}", 0)[src]
        if self.rank != src:
            tensor.copy_(source)
        return Work.done(tensor)

    def barrier(self, label: str) -> Work:
        key = self._key(_OTHER)
        self._post(key, None)
        self._collect(key, "barrier", f"barrier {label}", 0)
        return Work.done()

    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        key = self._key(_OTHER)
        self._post(key, pickle.dumps(obj) if self.rank == src else None)  # a copy, as a real transport makes
        return pickle.loads(self._collect(key, "broadcast", label, 0)[src])

    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        key = self._key(_OTHER)
        self._post(key, pickle.dumps(obj))
        return [pickle.loads(payload) for payload in self._collect(key, "all_gather", label, 0)]
