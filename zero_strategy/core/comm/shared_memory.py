"""The Comm of one host's CPU ranks: exchanges through the ranks' shared arenas and counters (see [Note:
shared-memory reductions] in shm_exchange.py) instead of the TCP loopback.

Reduce-scatters, the all-gathers of stages 1/2, small all-reduces (the agreement on used parameters, norms, flags)
and barriers go through the arenas; broadcasts and object exchanges go through the group's network Comm. EngineComms
(engine_comms.py) hands this Comm only the exchanges that fit an arena. The bytes a rank copies out of each peer's
arena are counted as moved from that peer (intra-host).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zero_strategy.core.comm.comm import Comm, ReduceOp, combine_in_rank_order
from zero_strategy.core.comm.shm_exchange import SharedExchange
from zero_strategy.core.comm.work import NOTHING, Work


class SharedMemoryComm(Comm):
    """Exchanges of one host's CPU ranks through shared memory; ``network`` carries the rest."""

    def __init__(self, exchange: SharedExchange, network: Comm) -> None:
        super().__init__(network.group, network.log)
        self._exchange = exchange
        self._network = network
        self._handed_out: Tensor | None = None  # the arena reduce_input gave for the next exchange
        self._closed = False  # after close (the engine's release) every exchange goes through the network

    @property
    def posted(self) -> int:
        """Exchanges this rank has posted through shared memory."""
        return self._exchange.posted

    @property
    def pairing_by_label(self) -> Comm:
        """The arenas pair exchanges by sequence alone: the network's tagged exchanges (see Comm)."""
        return self._network

    def fits(self, nbytes: int) -> bool:
        return not self._closed and self._exchange.fits(nbytes)

    @property
    def reductions_in_flight(self) -> int | None:
        return None  # the arenas are the exchange's own; it waits inside when they are all in use

    def _arena(self, numel: int, dtype: torch.dtype) -> Tensor:
        self._handed_out = self._exchange.next_buffer(numel, dtype)
        return self._handed_out

    def reduce_input(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        if not self.fits(numel * dtype.itemsize):
            return self._network.reduce_input(numel, dtype, device)
        return self._arena(numel, dtype)

    def _count_reads(self, kind: str, chunk_bytes: int) -> None:
        for peer in self.group.peers():
            self.log.record_moved(kind, self.group.me, self.group.global_rank(peer), chunk_bytes)

    def reduce_scatter(self, flat: Tensor, label: str, out: Tensor | None = None) -> Work:
        if not self.fits(flat.numel() * flat.element_size()):
            return self._network.reduce_scatter(flat, label, out)
        self.log.record_call("reduce_scatter", flat.numel() * flat.element_size())
        handed, self._handed_out = self._handed_out, None
        if handed is None or handed.data_ptr() != flat.data_ptr():  # not flattened into the arena: copy it there
            self._arena(flat.numel(), flat.dtype).copy_(flat)
            self._handed_out = None
        numel, dtype, size, rank = flat.numel(), flat.dtype, self.size, self.rank

        def mean_of_own_chunk(sequence: int) -> Tensor:
            """Every rank's contribution to this rank's chunk, summed in rank order, averaged."""
            lo, hi = rank * (numel // size), (rank + 1) * (numel // size)
            parts = self._exchange.arenas(sequence, numel, dtype)
            self._count_reads("reduce_scatter", (hi - lo) * dtype.itemsize)
            result = torch.add(parts[0][lo:hi], parts[1][lo:hi], out=out) if out is not None else \
                torch.add(parts[0][lo:hi], parts[1][lo:hi])
            for part in parts[2:]:
                result.add_(part[lo:hi])
            return result.div_(size)

        operation = self._exchange.post("reduce_scatter", f"reduce-scatter of unit {label!r}", mean_of_own_chunk)
        return Work(operation.wait)

    def all_gather(self, output: Tensor, shard: Tensor, label: str) -> Work:
        if not self.fits(output.numel() * output.element_size()):
            return self._network.all_gather(output, shard, label)
        self.log.record_call("all_gather", output.numel() * output.element_size())
        buffer = self._arena(output.numel(), output.dtype)
        self._handed_out = None
        buffer.chunk(self.size)[self.rank].copy_(shard)
        own = output.chunk(self.size)[self.rank]
        own_in_place = own.data_ptr() == shard.data_ptr()

        def copy_peer_chunks(sequence: int) -> Tensor:
            chunks = output.chunk(self.size)
            for rank, arena in enumerate(self._exchange.arenas(sequence, output.numel(), output.dtype)):
                if rank != self.rank or not own_in_place:
                    chunks[rank].copy_(arena.chunk(self.size)[rank])
            self._count_reads("all_gather", own.numel() * own.element_size())
            return output

        operation = self._exchange.post("all_gather", f"all-gather of unit {label!r}", copy_peer_chunks)
        return Work(operation.wait)

    def all_reduce(self, tensor: Tensor, op: ReduceOp, label: str) -> Work:
        """Each rank posts its copy at the start of its arena and reads every rank's: the same rank-order sum (or
        maximum) everywhere. A tensor larger than an arena goes through the network."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.fits(nbytes) or tensor.device.type != "cpu":
            return self._network.all_reduce(tensor, op, label)
        self.log.record_call("all_reduce", nbytes)
        count, dtype = tensor.numel(), tensor.dtype
        self._arena(count, dtype).copy_(tensor.reshape(-1))
        self._handed_out = None

        def reduce(sequence: int) -> Tensor:
            parts = self._exchange.arenas(sequence, count, dtype)
            self._count_reads("all_reduce", nbytes)
            return tensor.copy_(combine_in_rank_order(parts, op).view_as(tensor))

        operation = self._exchange.post("all_reduce", f"all-reduce of {label}", reduce)
        return Work(operation.wait)

    def barrier(self, label: str) -> Work:
        """A post of the next sequence number with no bytes, then the wait (no round trip through gloo's I/O
        threads, whose barrier costs far more than this spin). The exchanges in flight are read first."""
        if self._closed:
            return self._network.barrier(label)
        self._exchange.read_all_in_flight()
        self._exchange.post("barrier", f"barrier {label}", lambda sequence: NOTHING).wait()
        return Work.done()

    def broadcast(self, tensor: Tensor, src: int, label: str) -> Work:
        return self._network.broadcast(tensor, src, label)

    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        return self._network.broadcast_object(obj, src, label)

    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        return self._network.all_gather_object(obj, label)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._exchange.close()
