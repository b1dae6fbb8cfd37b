"""The Comm of a group of one rank: every exchange is a local copy (``world_size == 1`` runs through the same code
path as any other world, with the exchanges degenerate)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from zero_strategy.core.comm.comm import Comm, ReduceOp
from zero_strategy.core.comm.work import Work


class SoloComm(Comm):
    """One rank: nothing leaves the process; calls are still counted, so figures compare across world sizes."""

    def all_gather(self, output: Tensor, shard: Tensor, label: str) -> Work:
        self.log.record_call("all_gather", output.numel() * output.element_size())
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return Work.done(output)

    def reduce_scatter(self, flat: Tensor, label: str, out: Tensor | None = None) -> Work:
        self.log.record_call("reduce_scatter", flat.numel() * flat.element_size())
        if out is None:
            return Work.done(flat.clone())
        return Work.done(out.copy_(flat))

    def all_reduce(self, tensor: Tensor, op: ReduceOp, label: str) -> Work:
        self.log.record_call("all_reduce", tensor.numel() * tensor.element_size())
        return Work.done(tensor)

    def broadcast(self, tensor: Tensor, src: int, label: str) -> Work:
        self.log.record_call("broadcast", tensor.numel() * tensor.element_size())
        return Work.done(tensor)

    def barrier(self, label: str) -> Work:
        return Work.done()

    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        return obj

    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        return [obj]
