"""The backend's own collectives (NCCL's are optimal; on gloo ``collectives="native"`` asks for them).

The bytes handed to each collective are counted under the link ``"collective"``: the backend alone decides which
peer receives what (see [Note: counting bytes where they move] in log.py).

The backend's collectives carry no label: a collective only some ranks make pairs with whatever collective the
peers make next. So on gloo the gathers of a stage-3 parameter used outside forward (which a rank may make alone,
see [Note: parameters outside forward] in core/flat/access.py) go through tagged point-to-point exchanges instead,
which never pair with a collective: a rank left alone waits, and the divergence watch stops every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from zero_strategy.core.comm.backend import BackendComm
from zero_strategy.core.comm.comm import OUTSIDE_FORWARD, ReduceOp
from zero_strategy.core.comm.group import check_device, on_collective_device
from zero_strategy.core.comm.log import COLLECTIVE_PEER
from zero_strategy.core.comm.point_to_point import PointToPointComm
from zero_strategy.core.comm.work import Work

_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}


class NativeComm(BackendComm):
    """``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``broadcast`` of the backend."""

    def _handed(self, kind: str, nbytes: int) -> None:
        self.log.record_moved(kind, self.group.me, COLLECTIVE_PEER, nbytes)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._tagged: PointToPointComm | None = None  # gloo: the gathers some ranks may make alone (see above)

    def all_gather(self, output: Tensor, shard: Tensor, label: str) -> Work:
        if label.endswith(OUTSIDE_FORWARD) and self.group.backend == "gloo":
            if self._tagged is None:
                self._tagged = PointToPointComm(self.group, self.log)
            return self._tagged.all_gather(output, shard, label)
        self.log.record_call("all_gather", output.numel() * output.element_size())
        check_device(output, self.group, "all-gather output")
        # a collective must not read the buffer it writes (the shard may be this rank's chunk of the output)
        own = output.chunk(self.size)[self.rank]
        source = shard.clone() if shard.data_ptr() == own.data_ptr() else shard
        self._handed("all_gather", source.numel() * source.element_size())
        with self.log.blocking("all_gather"):
            work = dist.all_gather_into_tensor(output, source, group=self.group.handle, async_op=True)
        return Work(lambda: self._wait("all_gather", work, output, source))

    def reduce_scatter(self, flat: Tensor, label: str, out: Tensor | None = None) -> Work:
        self.log.record_call("reduce_scatter", flat.numel() * flat.element_size())
        check_device(flat, self.group, "reduce-scatter input")
        result = torch.empty(flat.numel() // self.size, dtype=flat.dtype, device=flat.device) if out is None else out
        self._handed("reduce_scatter", flat.numel() * flat.element_size())
        with self.log.blocking("reduce_scatter"):
            work = dist.reduce_scatter_tensor(result, flat, op=dist.ReduceOp.SUM, group=self.group.handle,
                                              async_op=True)

        def finish() -> Tensor:
            self._wait("reduce_scatter", work, result, flat)
            return result.div_(self.size)

        return Work(finish)

    def _wait(self, kind: str, work: dist.Work | None, result: Tensor, *keep_alive: Tensor) -> Tensor:
        """Wait for ``work``; ``keep_alive`` (the buffers it reads) is held until then by this call's frame."""
        assert work is not None, "async_op=True returns a Work"
        with self.log.blocking(kind):
            work.wait()
        return result

    def all_reduce(self, tensor: Tensor, op: ReduceOp, label: str) -> Work:
        nbytes = tensor.numel() * tensor.element_size()
        self.log.record_call("all_reduce", nbytes)
        self._handed("all_reduce", nbytes)
        with self.log.blocking("all_reduce"), on_collective_device(tensor, self.group) as moved:
            dist.all_reduce(moved, op=_OPS[op], group=self.group.handle)
            if op is ReduceOp.MEAN:
                moved.div_(self.size)
        return Work.done(tensor)

    def broadcast(self, tensor: Tensor, src: int, label: str) -> Work:
        nbytes = tensor.numel() * tensor.element_size()
        self.log.record_call("broadcast", nbytes)
        if self.rank == src:
            self._handed("broadcast", nbytes)
        with self.log.blocking("broadcast"), on_collective_device(tensor, self.group) as moved:
            dist.broadcast(moved, src=self.group.global_rank(src), group=self.group.handle)
        return Work.done(tensor)
