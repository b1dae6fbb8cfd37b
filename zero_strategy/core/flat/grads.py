"""A FlatParam's gradients on their way from the module's ``.grad`` to its master pieces' ``.grad``.

Per reduction: the module's gradients are flattened (laid out like the gathered buffer, zeros where a parameter
has none and in the padding; the module's ``.grad`` tensors are released: the flat copy is now the only one), one
reduce-scatter averages them over the shard group, and this rank's slice is added to the master pieces' gradients
(fp32, where the masters live). Stage 1 under bf16/fp16 first accumulates the module's gradients in an fp32 stash
as they are produced, so accumulation over micro-steps never happens in the low precision.

The gradient belongs to the FlatParam, not to an optimizer: every optimizer that steps it reads the same one, as
under DDP, where the optimizers holding a parameter share its ``.grad``. An optimizer step does not consume it;
only :meth:`GradientSlices.discard` (``zero_grad()`` of any optimizer that steps the FlatParam, a skipped step)
clears it (see [Note: optimizers sharing parameters] in engine/window.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from enum import Enum, auto

import torch
from torch import Tensor, nn

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.streams import CollectiveStreams
from zero_strategy.core.comm.work import Work
from zero_strategy.core.flat.access import own_grad, set_own_grad
from zero_strategy.core.flat.master import MasterPieces
from zero_strategy.core.flat.storage import FlatStorage
from zero_strategy.core.plan.flat_specs import FlatSpec
from zero_strategy.core.plan.tensor_parallel import local_gradient


class ReduceState(Enum):
    """Where the FlatParam's reduction stands (one in flight at a time)."""

    IDLE = auto()  # nothing in flight
    REDUCING = auto()  # a reduce-scatter in flight
    COPYING = auto()  # offload on a GPU: the reduced slice on its way to pinned host memory


class SliceState(Enum):
    """What the master pieces' gradients hold since the last step."""

    EMPTY = auto()  # nothing reduced yet
    LOCAL = auto()  # averaged over the shard group, not yet over the replicas (hybrid sharding)
    FINAL = auto()  # averaged over every rank of the run


class Scaling(Enum):
    """Whether the master pieces' gradients still carry the fp16 loss scale (fp32 and bf16 stay SCALED, by 1)."""

    SCALED = auto()  # as backward produced them
    UNSCALED = auto()  # a step window multiplied them by 1/scale: a second optimizer stepping them must not again
    MIXED = auto()  # a reduction landed after the unscaling: part of them carries the scale, part does not


class GradientScaleError(RuntimeError):
    """fp16: a gradient holds a mix of scaled and unscaled values, which no single unscaling can fix."""


class GradientSlices:
    """The reduction of one FlatParam's gradients and their accumulation into its master pieces."""

    stash: Tensor | None  # stage 1 in low precision: fp32 full gradients between steps (padded, flat)
    seen: list[bool]  # which parameters produced a gradient since it was last cleared (this rank, or agreed)

    def __init__(
        self, spec: FlatSpec, params: list[nn.Parameter], comm: Comm, storage: FlatStorage, pieces: MasterPieces,
        has_replicas: bool, streams: CollectiveStreams | None,
    ) -> None:
        self.spec = spec
        self.params = params
        self.comm = comm
        self.storage = storage
        self.pieces = pieces
        self.has_replicas = has_replicas
        self.streams = streams
        self.stash = None
        self.seen = [False] * len(params)
        self.state = ReduceState.IDLE
        self.slice_state = SliceState.EMPTY
        self.scaling = Scaling.SCALED
        self._work: Work | None = None
        self._host_copies: list[tuple[nn.Parameter, int, Tensor]] = []  # (piece, offset, pinned host values)
        self._copies_ready: object | None = None  # the event after which the host copies are complete
        self._copies_read_from: list[Tensor] = []  # the device slices those copies read
        # Moves whenever the slices' gradient changes (a reduction landed, unscaling, clipping, zero_grad): what a
        # copy of them made for a read of p.grad compares with (see [Note: p.grad as under DDP] in
        # engine/ddp_gradients.py). Every rank changes its slices at the same points, so the version is the same on
        # every rank.
        self.version = 0
        # Called with this object's FlatParam before the slices change: a user's edit of a p.grad copy goes in first
        self.before_change: weakref.WeakMethod | None = None
        self.owner: object | None = None  # the FlatParam (set by it), passed to ``before_change``

    def changed(self) -> None:
        """The slices' gradient changed (here, or by clipping in core/engine/gradients.py)."""
        self.version += 1

    def _about_to_change(self) -> None:
        callback = self.before_change() if self.before_change is not None else None
        if callback is not None:
            callback(self.owner)

    # ----------------------------------------------------------------------------------------- flattening
    def stash_grad(self, index: int) -> None:
        """Move parameter ``index``'s gradient into the fp32 stash (stage 1 in low precision)."""
        param = self.params[index]
        grad = own_grad(param)
        if grad is None:
            return
        grad = local_gradient(grad, param)  # see [Note: ZeRO over the data-parallel dimension of a 2-D mesh]
        if self.stash is None:
            self.stash = torch.zeros(self.spec.layout.padded_numel, dtype=torch.float32,
                                     device=self.storage.full.tensor.device)
        span = self.spec.layout.spans[index]
        self.stash[span.offset : span.end].add_(grad.reshape(-1))
        set_own_grad(param, None)
        self.seen[index] = True

    def _flatten(self, target: Tensor | None) -> Tensor:
        """The module's gradients laid out like the gathered buffer, in ``target`` or a new tensor; the module's
        ``.grad`` tensors (and the stash) are released."""
        stash, self.stash = self.stash, None
        layout, dtype = self.spec.layout, self.spec.reduce_dtype
        if target is None:
            target = stash.to(dtype) if stash is not None else torch.empty(
                layout.padded_numel, dtype=dtype, device=self.storage.full.tensor.device)
        add = stash is not None
        if stash is not None:
            if target is not stash:
                target.copy_(stash)
        else:  # copy rather than zeros + add: one pass over the memory instead of two
            target[layout.numel :].zero_()
        for index, (span, param) in enumerate(zip(layout.spans, self.params, strict=True)):
            part = target[span.offset : span.end]
            grad = own_grad(param)
            if grad is not None:
                grad = local_gradient(grad, param)  # see [Note: ZeRO over the data-parallel dimension of a 2-D mesh]
                part.add_(grad.reshape(-1)) if add else part.copy_(grad.reshape(-1))
                set_own_grad(param, None)
                self.seen[index] = True
            elif not add:
                part.zero_()
        return target

    # ------------------------------------------------------------------------------------------ reducing
    def has_pending(self) -> bool:
        """Gradients on the module (or in the stash) not yet reduced."""
        return self.stash is not None or any(own_grad(p) is not None for p in self.params)

    def requires_grad_now(self) -> bool:
        """Whether autograd can produce a gradient for this FlatParam at all (a GAN toggles ``requires_grad``)."""
        return any(param.requires_grad for param in self.params)

    def start_reduce(self, force: bool = False) -> None:
        """Flatten the module's gradients and start reducing them; :meth:`finish_reduce` accumulates the result.
        ``force``: reduce even without a local gradient (zeros), because a peer has one and every rank must take
        part in every exchange (see [Note: collective order] in runtime/backward_reductions.py)."""
        if not (self.has_pending() or force):
            return
        self.finish_reduce()  # one reduction per FlatParam in flight
        numel, dtype = self.spec.layout.padded_numel, self.spec.reduce_dtype
        target = None if self.stash is not None else self.comm.reduce_input(numel, dtype,
                                                                             self.storage.full.tensor.device)
        self._work = self.comm.reduce_scatter(self._flatten(target), self.spec.label)
        self.state = ReduceState.REDUCING

    def finish_reduce(self) -> None:
        """Wait for the reduction in flight and add this rank's slice to the master pieces' gradients."""
        if self.state is not ReduceState.REDUCING:
            return
        assert self._work is not None
        reduced, self._work = self._work.wait(), None
        self.state = ReduceState.IDLE
        self.slice_state = SliceState.LOCAL if self.has_replicas and self.pieces else SliceState.FINAL
        streams = self.streams
        if streams is not None and streams.enabled and reduced.is_cuda and self.storage.shard.device.type == "cpu":
            self._start_host_copies(reduced, streams)
            return
        self._accumulate((piece, offset, reduced[offset : offset + piece.numel()]) for piece, offset in self.pieces)

    def _accumulate(self, slices: Iterable[tuple[nn.Parameter, int, Tensor]]) -> None:
        """Add each (master piece, its offset in the shard, reduced values) to the piece's gradient, creating it on
        the first reduction of a step."""
        self._about_to_change()
        self.changed()
        if self.scaling is Scaling.UNSCALED:  # these values carry the loss scale, the others no longer do
            self.scaling = Scaling.MIXED
        grad_file = self.storage.grad_file
        for piece, offset, values in slices:
            if piece.grad is not None:
                piece.grad.add_(values.to(piece.device))
            elif grad_file is not None:  # see [Note: gradient slices in files]
                piece.grad = grad_file[offset : offset + piece.numel()]
                piece.grad.copy_(values)
            else:  # the reduced slice is ours alone and its pieces are disjoint: used without a copy
                piece.grad = values.to(device=piece.device, dtype=piece.dtype)
        if grad_file is not None:
            self.storage.after_host_read()  # the slice is in the file: its pages leave this process

    def _start_host_copies(self, reduced: Tensor, streams: CollectiveStreams) -> None:
        """Offloaded masters on a GPU: copy the reduced slice to pinned host memory on the copy stream, without
        blocking; :meth:`settle_host_copies` adds it to the master pieces' grads. One copy in flight per FlatParam
        (the previous one is settled first), so host memory holds at most one extra slice."""
        self.settle_host_copies()
        host, self._copies_ready = streams.copy_to_host(reduced, self.storage.shard.dtype)
        self._copies_read_from = [reduced]
        self._host_copies = [(piece, offset, host[offset : offset + piece.numel()]) for piece, offset in self.pieces]
        self.state = ReduceState.COPYING

    def settle_host_copies(self) -> None:
        """Wait for the host copies and accumulate them (the host reads the gradients next: the CPU optimizer, the
        norm). Also orders any earlier non-blocking host-to-device read of the shard before the optimizer writes
        it: the copy stream waited for the compute stream, where those reads were queued."""
        if self.state is not ReduceState.COPYING:
            return
        self._copies_ready.synchronize()  # type: ignore[union-attr]
        self._accumulate(self._host_copies)
        self._host_copies, self._copies_read_from, self._copies_ready = [], [], None
        self.state = ReduceState.IDLE

    # ------------------------------------------------------------------------------------------ the step
    def unscale(self, inv_scale: float) -> None:
        """fp16: multiply the reduced gradient by ``inv_scale``, once: a second optimizer stepping this FlatParam
        (no ``zero_grad()`` in between) finds it done. A gradient that also holds values reduced after its
        unscaling cannot be unscaled right: that is an error, raised on every rank alike (reductions and
        unscalings happen at the same points everywhere)."""
        if self.scaling is Scaling.MIXED:
            raise GradientScaleError(
                f"ZeRO fp16: the gradients of {self.spec.label} were reduced again after they had been unscaled (a "
                "backward after clipping, or after another optimizer's step over the same parameters, without "
                "zero_grad() in between), so part of them carries the loss scale and part does not. Call "
                "zero_grad() after each optimizer step and clip after the step's last backward."
            )
        grads = [piece.grad for piece in self.pieces.pieces if piece.grad is not None]
        if self.scaling is Scaling.UNSCALED or not grads:  # done already, or nothing to unscale yet
            return
        if inv_scale != 1.0:
            self._about_to_change()
            self.changed()
            for grad in grads:
                grad.mul_(inv_scale)
        self.scaling = Scaling.UNSCALED

    def discard(self) -> None:
        """Drop every gradient (``zero_grad()``, a skipped step). A reduction in flight completes first: every rank
        takes part in every exchange, whatever it does with the result."""
        self.finish_reduce()
        self.settle_host_copies()
        self.stash = None
        self.seen = [False] * len(self.params)
        self.changed()
        self.slice_state = SliceState.EMPTY
        self.scaling = Scaling.SCALED
        for param in self.params:
            set_own_grad(param, None)
        for piece, _ in self.pieces:
            piece.grad = None

    def note_local_use(self) -> None:
        """Mark the parameters holding a gradient not yet flattened (stage 1 keeps them until the step) as used."""
        self.seen = [seen or own_grad(p) is not None for seen, p in zip(self.seen, self.params, strict=True)]

    def forget(self, index: int) -> None:
        """Parameter ``index``'s gradient is cleared (``nn.Module.zero_grad()``): zeros in the slices and the stash,
        and not produced since (the module's ``.grad`` is torch's to clear)."""
        span = self.spec.layout.spans[index]
        start = self.storage.own_range[0]
        self.finish_reduce()
        self.settle_host_copies()
        for piece, offset in self.pieces:
            lo, hi = max(span.offset, start + offset), min(span.end, start + offset + piece.numel())
            if piece.grad is not None and lo < hi:
                piece.grad[lo - start - offset : hi - start - offset].zero_()
        if self.stash is not None:
            self.stash[span.offset : span.end].zero_()
        self.seen[index] = False
        self.changed()

    def assign(self, index: int, value: Tensor | None, held: bool) -> None:
        """``p.grad = value`` for parameter ``index`` (see [Note: p.grad as under DDP] in engine/ddp_gradients.py).
        ``held`` (DDP's ``p.grad`` is this rank's own sum): ``value`` becomes that sum, to be reduced with what
        later backwards add, and the parameter's range of the slices is cleared. Otherwise ``value`` is the averaged
        gradient: this rank's range of it goes into the slices, replacing what was reduced there, and nothing of
        the parameter waits to be reduced. None: the parameter has no gradient (the step skips it). Local."""
        span = self.spec.layout.spans[index]
        param = self.params[index]
        self.finish_reduce()
        self.settle_host_copies()
        set_own_grad(param, None)
        if self.stash is not None:
            self.stash[span.offset : span.end].zero_()
        flat_value = None if value is None else value.detach().reshape(-1)
        if held and flat_value is not None:  # the rank's own sum: where backward puts it
            if self.stash is not None:
                self.stash[span.offset : span.end].copy_(flat_value)
            else:
                set_own_grad(param, flat_value.view(span.shape).to(dtype=param.dtype, device=param.device))
        into_slices = None if held else flat_value
        start = self.storage.own_range[0]
        for piece, offset in self.pieces:
            lo, hi = max(span.offset, start + offset), min(span.end, start + offset + piece.numel())
            if lo >= hi or (piece.grad is None and into_slices is None):
                continue
            grad = piece.grad if piece.grad is not None else self._zero_grad_of(piece, offset)
            part = grad[lo - start - offset : hi - start - offset]
            part.zero_() if into_slices is None else part.copy_(into_slices[lo - span.offset : hi - span.offset])
        if into_slices is not None and self.slice_state is SliceState.EMPTY:
            self.slice_state = SliceState.LOCAL if self.has_replicas else SliceState.FINAL
        if self.storage.grad_file is not None:
            self.storage.after_host_read()
        self.seen[index] = value is not None
        self.changed()

    def _zero_grad_of(self, piece: nn.Parameter, offset: int) -> Tensor:
        """Give a master piece a gradient of zeros (in the gradient file with nvme offload, see [Note: gradient
        slices in files]) and return it."""
        grad_file = self.storage.grad_file
        grad = grad_file[offset : offset + piece.numel()].zero_() if grad_file is not None else torch.zeros_like(piece)
        piece.grad = grad
        return grad

    def pending_sum(self, index: int) -> Tensor | None:
        """This rank's own gradient of parameter ``index`` not reduced yet: on the module, or in the fp32 stash
        (a view: a change to it is a change to what will be reduced); None when it has none."""
        grad = own_grad(self.params[index])
        if grad is not None or self.stash is None or not self.seen[index]:
            return grad
        span = self.spec.layout.spans[index]
        return self.stash[span.offset : span.end].view(span.shape)

    def slices_empty(self) -> bool:
        """Nothing was reduced into the slices since they were last cleared (the same answer on every rank)."""
        return self.slice_state is SliceState.EMPTY

    def unused_ranges(self, rank: int) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of this rank's shard holding parameters that produced no gradient this step."""
        seen = {span.name: used for span, used in zip(self.spec.layout.spans, self.seen, strict=True)}
        return [(o.shard_start, o.shard_start + o.numel) for o in self.spec.layout.overlaps(rank) if not seen[o.name]]
