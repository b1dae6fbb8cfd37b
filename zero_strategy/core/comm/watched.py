"""A Comm decorator that puts every wait of an engine's network exchanges under the divergence watch (see [Note:
diverging gathers] in watch.py): used at stage 3 when gathers go through the network on CPU ranks."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from zero_strategy.core.comm.comm import Comm, ReduceOp
from zero_strategy.core.comm.watch import DivergedGathersError, GatherWatch, WatchState, remedy
from zero_strategy.core.comm.work import Work

T = TypeVar("T")
_watch_numbers = itertools.count()  # one store namespace per watch (engines are built in the same order everywhere)


class WatchedComm(Comm):
    """``inner``'s exchanges, counted and waited for through a :class:`GatherWatch` (which owns a thread: stopped
    when this Comm is closed, after which the exchanges run unwatched)."""

    def __init__(self, inner: Comm) -> None:
        super().__init__(inner.group, inner.log)
        self._inner = inner
        key = f"{next(_watch_numbers)}/{'-'.join(map(str, inner.group.members))}"  # groups share one store
        self.watch = GatherWatch(inner.rank, inner.size, key)

    @property
    def _closed(self) -> bool:
        return self.watch.state is WatchState.CLOSED

    def _watched(self, kind: str, label: str, work: Work) -> Work:
        if self._closed:  # released with its engine: what follows (a save after fit) runs unwatched
            return work
        number = self.watch.post(kind, label)
        return Work(lambda: self.watch.wait(kind, number, label, work.wait))

    def all_gather(self, output: Tensor, shard: Tensor, label: str) -> Work:
        if not self._closed:
            self.watch.raise_if_diverged(label)
        return self._watched("gather", label, self._inner.all_gather(output, shard, label))

    def reduce_scatter(self, flat: Tensor, label: str, out: Tensor | None = None) -> Work:
        if not self._closed:
            self.watch.raise_if_diverged(label)
        return self._watched("reduce", label, self._inner.reduce_scatter(flat, label, out))

    def reduce_input(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self._inner.reduce_input(numel, dtype, device)

    @property
    def reductions_in_flight(self) -> int | None:
        return self._inner.reductions_in_flight

    def _call(self, label: str, exchange: Callable[[], T]) -> T:
        """A blocking exchange of the engine's own, posted and waited for through the watch."""
        return exchange() if self._closed else self.watch.call(label, exchange)  # raises a verdict before it runs

    def all_reduce(self, tensor: Tensor, op: ReduceOp, label: str) -> Work:
        return Work.done(self._call(label, lambda: self._inner.all_reduce(tensor, op, label).wait()))

    def broadcast(self, tensor: Tensor, src: int, label: str) -> Work:
        return Work.done(self._call(label, lambda: self._inner.broadcast(tensor, src, label).wait()))

    def barrier(self, label: str) -> Work:
        return Work.done(self._call(label, lambda: self._inner.barrier(label).wait()))

    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        return self._call(label, lambda: self._inner.broadcast_object(obj, src, label))

    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        return self._call(label, lambda: self._inner.all_gather_object(obj, label))

    def verify_step(self) -> None:
        """Every rank gathered the same units since the last step (with ``collectives="native"`` the backend's
        gathers cannot carry the unit, so equal-sized gathers of different units would pair up): 16 bytes."""
        if self._closed:
            return
        fingerprint = self.watch.take_fingerprint()
        both = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64)
        largest, negated_smallest = self.all_reduce(both, ReduceOp.MAX, "gather check").wait().tolist()
        if largest != -negated_smallest:
            raise DivergedGathersError(
                "ZeRO stage 3: the ranks gathered different units in this step (a module called on some ranks "
                "only); the step is not taken. " + remedy()
            )
        self._inner.verify_step()

    def close(self) -> None:
        self.watch.close()
        self._inner.close()
