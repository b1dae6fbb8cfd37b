"""CUDA streams for gathers, reductions and offload copies: a Comm decorator and the streams it issues on. Used
only where the compute device is a GPU; elsewhere the plan does not wrap, and the host copies below are plain.

[Note: streams for gathers and reductions]
On a GPU, kernels run in stream order, not in the order the host returns from calls. Three side streams, one set
per compute device, keep communication off the compute stream (the design of torch's FSDP2, not its code):
- *gather*: stage-3 all-gathers (and the stage 1/2 refresh after a step). A gather is issued on the gather stream
  after it waited for the compute stream (the shard it sends, or its cast, was written there); the gather stream
  waits for NCCL's own stream, and an event recorded then marks "the gathered values are there". The compute
  stream waits for that event when the unit is first used (:meth:`StreamReady.wait`), not before, so a prefetch
  overlaps the computation of the unit before it. The host never blocks.
- *reduce*: reduce-scatters, the same way: issued after the gradients were flattened on the compute stream;
  the compute stream waits for the event only where the reduced slice is read (the next unit's reduction, or the
  end of backward), so the reduction overlaps the backward of the next unit.
:class:`StreamedComm` applies this to any Comm's gathers and reductions (network or hierarchical), so every
caller gets it without asking.
- *copy*: device-to-host copies of reduced gradient slices into pinned host buffers when the optimizer lives on
  the CPU (offload), non-blocking, so they overlap the rest of backward; the host waits for them once, before the
  CPU optimizer reads them.

Lifetimes: every buffer a collective or a copy reads or writes is allocated on the compute stream before it is
issued and is held by Python (:class:`StreamReady`, the host-copy list) until the compute stream (or, for host
copies, the host) has waited for the event that follows the last use. Only then is it dropped, and the caching
allocator reuses its block in compute-stream order, after that wait: no ``record_stream`` is needed, and freeing
stays deterministic. ``full`` of a stage-3 unit is resized to zero bytes only after its pending gather was waited
for (FlatParam.reshard).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from zero_strategy.core.comm.comm import Comm, ReduceOp
from zero_strategy.core.comm.work import Work


class StreamReady:
    """A collective issued on a side stream; ``wait()`` makes the *current* stream wait for it (the host does not),
    then lets go of the buffers it touched, and returns the collective's result."""

    def __init__(
        self, event: Any, device: torch.device, keep_alive: tuple[Tensor, ...],
        timing: Callable[[Any, Any], None] | None, result: Tensor,
    ) -> None:
        self._event = event
        self._device = device
        self._keep_alive = keep_alive
        self._timing = timing  # records how long the compute stream stalled here (the profiler's device time)
        self._result = result

    def wait(self) -> Tensor:
        if self._event is None:
            return self._result
        stream = torch.cuda.current_stream(self._device)
        if self._timing is not None:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.record_event(before)
            stream.wait_event(self._event)
            stream.record_event(after)
            self._timing(before, after)
        else:
            stream.wait_event(self._event)
        self._event, self._keep_alive = None, ()
        return self._result


class CollectiveStreams:
    """The side streams of one compute device (see [Note: streams for gathers and reductions]); ``enabled`` only on
    CUDA, and every method is a no-op (or a plain call) otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        self._streams: dict[str, Any] = {}
        if self.enabled:
            self._streams = {kind: torch.cuda.Stream(device) for kind in ("gather", "reduce", "copy")}

    @staticmethod
    def for_device(device: torch.device) -> CollectiveStreams:
        return CollectiveStreams(device)

    def run(self, kind: str, issue: Callable[[], Any]) -> Any:
        """Issue ``issue()`` (which must leave the current stream waiting for what it started) on the ``kind`` side
        stream after the compute stream's work so far; returns the event that marks its end (None when disabled,
        after simply calling ``issue``)."""
        if not self.enabled:
            issue()
            return None
        side = self._streams[kind]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            issue()
            return side.record_event()

    def ready(
        self, kind: str, issue: Callable[[], Any], keep_alive: tuple[Tensor, ...], result: Tensor,
        timing: Callable[[Any, Any], None] | None = None,
    ) -> Work:
        """:meth:`run`, as a Work that holds ``keep_alive`` until the compute stream waited for it."""
        return Work(StreamReady(self.run(kind, issue), self.device, keep_alive, timing, result).wait)

    def copy_to_host(self, source: Tensor, dtype: torch.dtype) -> tuple[Tensor, Any]:
        """A pinned host copy of ``source`` (in ``dtype``) started on the copy stream, and the event after which
        the host may read it. ``source`` must be kept alive by the caller until then."""
        host = torch.empty(source.shape, dtype=dtype, device="cpu", pin_memory=True)
        side = self._streams["copy"]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host.copy_(source, non_blocking=True)
            return host, side.record_event()


class StreamedComm(Comm):
    """``inner``'s gathers and reductions issued on the side streams of ``streams`` (see [Note: streams for gathers
    and reductions]); the small exchanges run as ``inner``'s, on the compute stream."""

    def __init__(self, inner: Comm, streams: CollectiveStreams) -> None:
        super().__init__(inner.group, inner.log)
        self._inner = inner
        self._streams = streams

    def all_gather(self, output: Tensor, shard: Tensor, label: str) -> Work:
        if not output.is_cuda:
            return self._inner.all_gather(output, shard, label)
        issue = lambda: self._inner.all_gather(output, shard, label).wait()  # noqa: E731
        return self._streams.ready("gather", issue, (output, shard), output, self.log.stream_timer("all_gather"))

    def reduce_scatter(self, flat: Tensor, label: str, out: Tensor | None = None) -> Work:
        if not flat.is_cuda:
            return self._inner.reduce_scatter(flat, label, out)
        # the result is allocated here, on the compute stream, so the caching allocator reuses it in that order
        result = torch.empty(flat.numel() // self.size, dtype=flat.dtype, device=flat.device) if out is None else out
        issue = lambda: self._inner.reduce_scatter(flat, label, result).wait()  # noqa: E731
        timer = self.log.stream_timer("reduce_scatter")
        return self._streams.ready("reduce", issue, (flat, result), result, timer)

    def reduce_input(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self._inner.reduce_input(numel, dtype, device)

    @property
    def reductions_in_flight(self) -> int | None:
        return self._inner.reductions_in_flight

    def all_reduce(self, tensor: Tensor, op: ReduceOp, label: str) -> Work:
        return self._inner.all_reduce(tensor, op, label)

    def broadcast(self, tensor: Tensor, src: int, label: str) -> Work:
        return self._inner.broadcast(tensor, src, label)

    def barrier(self, label: str) -> Work:
        return self._inner.barrier(label)

    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        return self._inner.broadcast_object(obj, src, label)

    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        return self._inner.all_gather_object(obj, label)

    def verify_step(self) -> None:
        self._inner.verify_step()

    def close(self) -> None:
        self._inner.close()


def _pinned(host: Tensor) -> Tensor:
    """``host`` itself when pinned, else a pinned copy (file-backed nvme shards, unpinned host memory): a
    non-blocking copy from it does not stall the host, and torch's pinned-memory allocator keeps the copy's
    buffer until the transfer is done."""
    return host if host.is_pinned() else host.pin_memory()


def host_to_device(host: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``host`` on ``device`` in ``dtype``; host memory reaches a GPU without blocking the host (ordered on the
    current stream before whatever reads the result)."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device=device, dtype=dtype)
    return _pinned(host).to(device=device, dtype=dtype, non_blocking=True)


def copy_host_to_device(target: Tensor, host: Tensor) -> None:
    """``target.copy_(host)``, without blocking the host when ``target`` is on a GPU."""
    if target.is_cuda and host.device.type == "cpu":
        target.copy_(_pinned(host), non_blocking=True)
    else:
        target.copy_(host)
