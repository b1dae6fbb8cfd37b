"""What a read of ``p.grad`` returns under ZeRO: DDP's value, paid for only by code that reads it.

[Note: p.grad as under DDP]
Under DDP every rank's ``p.grad`` holds, after a backward that synchronizes (every backward without accumulation,
the last micro-batch of each window with it), the gradient averaged over the ranks; after a backward under
``no_sync`` (the micro-batches before the last) this rank's own sum since the last synchronization added to what
was there. It stays until ``zero_grad()``. ZeRO keeps the averaged gradient only as slices (stages 2/3 after each
backward, stage 1 at the step, stage 1 in bf16/fp16 first in an fp32 stash), so the module's ``.grad`` is None or
this rank's own sum. A read is answered instead of torch's attribute:

- after a backward inside an accumulation window (Fabric's ``no_backward_sync``; Lightning's micro-batches before
  the last): this rank's own sum, where torch or the fp32 stash keep it (no exchange; with slices already reduced
  earlier, those are gathered and added, as DDP's ``p.grad`` holds the earlier average plus the own sum). Stage 1
  keeps every gradient on the module until the step; stages 2/3 keep them there only under a hold, decided before
  the window's first backward: Fabric's ``no_backward_sync`` always; Lightning's window as the option
  ``keep_window_gradients`` says: True every window, False never, None (auto) when the module or a callback
  overrides ``on_after_backward``, or the module or a callback not of Lightning or this package overrides
  ``on_train_batch_end`` (lightning/gradient_hooks.py: code that may read there pays DDP's memory of full gradients
  during the window, other code keeps ZeRO's). A read inside a window whose gradients stages 2/3 reduced already
  raises :class:`GradientReadError` naming the remedies: no value it could return is DDP's (the slices hold the
  average over the ranks; this rank's own sum is gone unless it was kept, which is the memory stages 2/3 save, so
  paying only when read is impossible). On one rank the average is the own sum: the slices answer.
- otherwise the averaged gradient, in the masters' dtype (fp32 under mixed precision, where DDP's parameters and
  gradients are fp32 too; the parameters' own dtype where the module itself is bf16/fp16, as DDP's gradient is):
  the first read after the gradients changed reduces whatever is still pending (stage 1) and gathers every
  FlatParam's slices into one copy per FlatParam, which later reads return views of. That first read is a
  collective (every rank reads, as every rank of DDP synchronizes); Lightning's gradient hooks, where a read may
  happen on one rank only (``rank_zero_only``), make it before the hook runs (see :meth:`DdpGradients.gather_now`)
  when the module or a callback overrides one of them.
- None where no rank produced a gradient since it was last cleared, as under DDP. ``nn.Module.zero_grad()``
  clears it too (Lightning calls it before a validation outside an accumulation window), as it clears DDP's.

The copies are dropped when the gradients change (a reduction lands, fp16 unscaling, clipping, ``zero_grad()``)
and when the optimizer step starts (the optimizer's own memory peaks there). A change a user makes to a returned
gradient in place (``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)``, ``p.grad.mul_(...)``) is moved into
this rank's slices before the engine reads them next (the step, clipping, norms): every rank makes the same change,
as DDP's replicas do, so each rank's own range carries it. A gradient replaced by assignment (``p.grad = t``, in a
hook or in manual optimization) is what the step uses, as under DDP: ``t`` is the rank's whole gradient, so this
rank's range of it replaces the parameter's range of the slices (and nothing of the parameter still waits to be
reduced); inside an accumulation window with the gradients held, ``t`` becomes this rank's own sum. ``p.grad =
None`` clears the parameter's gradient: the step skips it (see [Note: unused parameters] in engine/unused.py). Every
rank assigns, as every DDP replica does; no exchange is made.

Where reads are seen: a stage-3 parameter has its sharded class outside forward (core/flat/access.py); stages 1/2
give their parameters a class that sees ``.grad`` reads from the end of each backward to the next forward
(core/flat/grad_reads.py; under the Trainer to the first forward of a module inside ``training_step``, see [Note:
reads until the model computes] in first_use.py), so forward itself never pays. Cost: nothing for a module that
reads no gradient; for one that does, at each step where it reads, one all-gather of the fp32 gradients (4 bytes
per parameter, received (N-1)/N of it) and their memory until the step starts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zero_strategy.core.engine.first_use import ReadsUntilFirstUse
from zero_strategy.core.flat.exact_writes import replays_writes
from zero_strategy.core.flat.flat_param import FlatParam, ParamState
from zero_strategy.core.flat.grad_reads import unwatch, watch, watch_whole
from zero_strategy.core.flat.whole import gather_whole

# the remedy both errors name (only the Trainer's windows reduce early: Fabric's no_backward_sync always holds)
_KEEP_THEM = (
    "Keep the window's gradients on the module (DDP's memory until the window's last backward) with the strategy "
    "option keep_window_gradients=True (ZeroStrategy(keep_window_gradients=True); Hydra: "
    "strategy.keep_window_gradients=true), or with it None (auto) by overriding on_after_backward or "
    "on_train_batch_end in the LightningModule or a callback"
)


class GradientReadError(RuntimeError):
    """``p.grad`` was read where ZeRO cannot give DDP's value (see [Note: p.grad as under DDP])."""


@dataclass(slots=True)
class _Copy:
    """One FlatParam's averaged gradient, whole, in the masters' dtype."""

    whole: Tensor
    slices_version: int  # the FlatParam's gradient version it was gathered at
    edits_seen: int  # ``whole._version`` when it last matched the slices


class DdpGradients:
    """The engine's answer to reads of ``p.grad`` (see [Note: p.grad as under DDP])."""

    def __init__(self, flats: list[FlatParam], reduce_all: Callable[[], None], reduces_every_microstep: bool,
                 single_rank: bool = False, entered_elsewhere: tuple[nn.Module, nn.Module] | None = None) -> None:
        """``reduce_all``: bring every optimizer's pending gradients onto its slices without ending any step's
        accumulation (collective). ``reduces_every_microstep``: stages 2/3. ``single_rank``: the run has one rank,
        whose slices reduced inside a window hold its own sum (DDP's value there). ``entered_elsewhere``: (the
        module, the entry), where an adapter's wrapper is the step's entry (the Trainer's: ``training_step`` runs
        inside); reads then run on to the model's first computation (see [Note: reads until the model computes])."""
        self.flats = flats
        self.reduce_all = reduce_all
        self.reduces_every_microstep = reduces_every_microstep
        self.single_rank = single_rank
        self.in_window = False  # a framework's accumulation window is open (DDP would not synchronize)
        self.last_backward_held = False  # the last backward kept this rank's own gradient (DDP: no_sync)
        self.last_backward_reduced_early = False  # ...ran in a window, but stages 2/3 reduced it (no hold)
        self._copies: dict[int, _Copy] = {}
        self._watched = False  # reads are answered: from the end of a backward to the next forward
        # the parameters whose in-place changes are replayed on the masters are watched outside forward from the
        # start (see core/flat/exact_writes.py)
        self._replaying = [flat for flat in flats if flat.keeps_full and replays_writes(flat)]
        self._replays_watched = bool(self._replaying)
        if self._replays_watched:
            watch(self._replaying, only_replaying=True)
        self._first_use: ReadsUntilFirstUse | None = None
        if entered_elsewhere is not None and ReadsUntilFirstUse.applies(entered_elsewhere[0]):
            params = {id(param) for flat in flats for param in flat.params}
            self._first_use = ReadsUntilFirstUse(*entered_elsewhere, params, self._watch_gathered,
                                                 self.before_forward)
        reader = weakref.WeakMethod(self.read)
        edits = weakref.WeakMethod(self.take_edits_of)
        for flat in flats:
            flat.grad_reader = reader
            flat.grads.before_change = edits

    # -------------------------------------------------------------------------------------------- lifecycle
    def after_backward(self, held: bool) -> None:
        """A backward ended (``held``: its gradients stayed on the module); reads are answered until the next
        forward."""
        # stage 1 keeps every backward's gradient on the module anyway: inside a window that is DDP's own sum
        self.last_backward_held = held or (self.in_window and not self.reduces_every_microstep)
        # one rank: the average over it is its own sum, so reads inside a window are answered from the slices
        self.last_backward_reduced_early = self.in_window and not self.last_backward_held and not self.single_rank
        self.take_edits()  # stage 1 reduced nothing in this backward: edits made before it still count
        self._copies.clear()  # on every rank alike: the next read gathers what this backward added
        if not self._watched:
            watch(self.flats)
            self._watched = True

    def at_step_entry(self) -> None:
        """A step's forward entered: reads end here, or at the model's first computation when deferred."""
        if self._first_use is None:
            self.before_forward()

    def _watch_gathered(self) -> None:
        """Stage 3's FlatParams whole at the step's entry (the root unit) answer reads until the model computes."""
        gathered = [flat for flat in self.flats if not flat.keeps_full and flat.state is ParamState.UNSHARDED]
        if gathered:
            watch_whole(gathered)
            self._watched = True

    def before_forward(self) -> None:
        """Forward computes with the parameters' own class (nothing in forward pays for reads)."""
        if self._watched or self._replays_watched:
            unwatch(self.flats)
            self._watched = False

    def after_forward(self, backward_follows: bool) -> None:
        """A forward ended. Where no backward follows (validation, prediction), the parameters whose in-place
        changes are replayed are watched again; after a training forward the backward's end watches them (a change
        between the two is one autograd refuses under DDP, and is taken in at the step)."""
        if self._replays_watched and not backward_follows:
            watch(self._replaying, only_replaying=True)

    def close(self) -> None:
        """The engine lets the module go: parameters take their own class back, nothing is kept."""
        if self._first_use is not None:
            self._first_use.remove()
        self.before_forward()
        self._replays_watched = False
        self._copies.clear()
        for flat in self.flats:
            flat.grad_reader = None
            flat.grads.before_change = None

    @contextmanager
    def window(self) -> Iterator[None]:
        """Backwards inside the block are an accumulation window's micro-batches before its last."""
        was_in_window, self.in_window = self.in_window, True
        try:
            yield
        finally:
            self.in_window = was_in_window

    # ------------------------------------------------------------------------------------------------ reads
    def read(self, flat: FlatParam, index: int, torch_value: Tensor | None) -> Tensor | None:
        """What ``p.grad`` of parameter ``index`` of ``flat`` reads (``torch_value``: torch's attribute)."""
        grads = flat.grads
        if not flat.trainable or not flat.optimizers:
            return torch_value  # no optimizer steps it: nothing moved its gradient
        if flat.keeps_full and not self._watched:  # watched for its in-place changes only (before a backward)
            return torch_value
        if self.last_backward_reduced_early:
            raise GradientReadError(
                f"ZeRO: {flat.names[index]}.grad was read inside a gradient accumulation window, where DDP's holds "
                f"this rank's own sum; stages 2/3 reduced it already. {_KEEP_THEM}, read it at the window's end "
                "(on_before_optimizer_step), or use zero1, which keeps them until the step."
            )
        if self.last_backward_held:
            own = grads.pending_sum(index)
            if grads.slices_empty():
                return own if own is not None or not grads.seen[index] else None
            averaged = self._averaged(flat, index)
            if own is None:
                return averaged
            return own + averaged if averaged is not None else own
        # never decided by what this rank alone holds: a peer may have produced the gradient (an unused parameter
        # here), and whether to gather must be the same answer on every rank
        return self._averaged(flat, index)

    def write(self, flat: FlatParam, index: int, value: Tensor | None) -> bool:
        """``p.grad = value`` for parameter ``index`` of ``flat`` (see [Note: p.grad as under DDP]); False where no
        optimizer steps it (torch's attribute takes it). Local: every rank assigns, as every DDP replica does."""
        if not flat.trainable or not flat.optimizers or (flat.keeps_full and not self._watched):
            return False
        name, span = flat.names[index], flat.layout.spans[index]
        if value is not None and (not isinstance(value, Tensor) or tuple(value.shape) != tuple(span.shape)):
            what = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
            raise RuntimeError(f"ZeRO: {name}.grad was assigned {what}; assign a tensor of the parameter's shape "
                               f"{tuple(span.shape)}, or None.")
        if self.last_backward_reduced_early:
            raise GradientReadError(
                f"ZeRO: {name}.grad was assigned inside a gradient accumulation window, where DDP's holds this rank's "
                f"own sum; stages 2/3 reduced it already. {_KEEP_THEM}, assign at the window's end "
                "(on_before_optimizer_step), or use zero1."
            )
        self.take_edits_of(flat)  # edits made to a returned gradient before the assignment go in first
        held = self.last_backward_held
        flat.grads.assign(index, value, held)
        copy = self._copies.get(id(flat))
        if copy is not None:  # later reads see the assignment without gathering again
            part = copy.whole[span.offset : span.end]
            with torch.no_grad():
                part.zero_() if value is None or held else part.copy_(value.detach().reshape(-1))
            copy.slices_version, copy.edits_seen = flat.grads.version, copy.whole._version
        return True

    def forget(self, flat: FlatParam, index: int) -> None:
        """``nn.Module.zero_grad()`` cleared parameter ``index``'s gradient (as DDP's, on every rank): its elements
        of this rank's slices (and of the fp32 stash) become zeros and it counts as not produced. Local."""
        flat.grads.forget(index)
        self._copies.pop(id(flat), None)

    def gather_now(self) -> None:
        """Make the averaged copies now, at a point every rank reaches (before Lightning's gradient hooks), so that
        reads inside need no exchange. Nothing after a held backward (reads are this rank's own there)."""
        if not self.last_backward_held and not self.last_backward_reduced_early and self._stale():
            self._refresh()

    def _stale(self) -> bool:
        """Whether some stepped FlatParam has no copy matching its slices (the same answer on every rank: the
        slices change at the same points everywhere)."""
        return any(
            (copy := self._copies.get(id(flat))) is None or copy.slices_version != flat.grads.version
            for flat in self.flats if flat.trainable and flat.optimizers
        )

    def _averaged(self, flat: FlatParam, index: int) -> Tensor | None:
        copy = self._copies.get(id(flat))
        if copy is None or copy.slices_version != flat.grads.version:
            self._refresh()
            copy = self._copies[id(flat)]
        if not flat.grads.seen[index]:
            return None
        span = flat.layout.spans[index]
        return copy.whole[span.offset : span.end].view(span.shape)

    def _refresh(self) -> None:
        """Reduce what is pending and gather every stepped FlatParam's slices (collective: the same FlatParams in
        the same order on every rank)."""
        self.take_edits()
        if not self.last_backward_held:
            self.reduce_all()
        self._copies.clear()
        for flat in self.flats:
            if not (flat.trainable and flat.optimizers):
                continue
            # the masters' dtype: fp32 under mixed precision (DDP's parameters are fp32 there), else the parameters'
            own = torch.zeros(flat.shard.numel(), dtype=flat.shard.dtype, device=flat.full.device)
            for piece, offset in flat.pieces:
                if piece.grad is not None:
                    own[offset : offset + piece.numel()].copy_(piece.grad.reshape(-1))
            whole = gather_whole(flat, own, f"{flat.label} gradient read")
            self._copies[id(flat)] = _Copy(whole, flat.grads.version, whole._version)

    # ------------------------------------------------------------------------------------------- the step
    def take_edits(self) -> None:
        """Changes users made in place to the returned gradients go into this rank's slices (see the Note). Called
        before the engine reads the slices."""
        for flat in self.flats:
            self.take_edits_of(flat)

    def take_edits_of(self, flat: FlatParam) -> None:
        """:meth:`take_edits` for one FlatParam (also called by its gradient before a reduction or the unscaling
        changes the slices, so that an edit is never overwritten by what came after it)."""
        copy = self._copies.get(id(flat))
        if copy is None or copy.whole._version == copy.edits_seen:
            return
        start = flat.storage.own_range[0]
        with torch.no_grad():
            for piece, offset in flat.pieces:
                if piece.grad is None:  # no rank produced a gradient there (or the step set it aside as unused)
                    continue
                piece.grad.copy_(copy.whole[start + offset : start + offset + piece.numel()])
        copy.edits_seen = copy.whole._version
        flat.grads.changed()
        copy.slices_version = flat.grads.version  # the copy and the slices agree again

    def drop(self) -> None:
        """The optimizer step starts: edits are in the slices, the copies' memory goes."""
        self.take_edits()
        self._copies.clear()
