"""When a unit's gradients are reduced during backward: as soon as they are all there, in one agreed order, or not
at all while gradients are held on the module (``no_backward_sync``).

[Note: overlapped reduction]
A unit's reduce-scatter is only started when its last gradient lands; it is waited for when the next unit's
starts, or at the end of backward. On gloo the point-to-point exchange runs on gloo's I/O thread, so the ranks
need not meet at every unit: backward of the next unit computes while the bytes move, and a rank that is a little
behind costs the other rank nothing until the wait. At most two units' flattened gradients are alive at once.
A Comm that owns its buffers (``Comm.reductions_in_flight`` is None: one host's shared-memory arenas) holds no
private memory while a reduction is in flight, so its reductions are not waited for at the next unit: the exchange
reads each one as soon as every rank posted it and lets a rank run a few reductions ahead of a slower peer (see
[Note: shared-memory reductions]), so the ranks' backward passes do not meet at every unit; all are finished at the
end of backward.

[Note: collective order]
Every rank must issue collectives in the same order, and take part in every one, even where the set of parameters
it used differs from its peers' (mixture-of-experts routing, a branch or a head used on some batches): DDP with
``find_unused_parameters=True`` averages a gradient over all ranks, with zeros from those that did not use the
parameter. Two rules give that:
- reductions start in one agreed order (:class:`ReductionOrder`): a unit whose last gradient landed starts only
  once every unit before it in that order has; the order is rank 0's readiness order, broadcast at the end of
  the first backward (which follows the units' reversed module order, the same on every rank);
- at the end of backward every trainable unit not yet reduced is reduced on every rank, with zeros where this rank
  has no gradient (skipped only where no parameter of it requires a gradient now, which is the same on every rank).
  A unit no rank used in a backward therefore still costs its reduction, as DDP's buckets do: deciding "used by
  some rank" first would need an agreement in the middle of the reductions, out of order with them for gloo's and
  NCCL's own collectives.
When all ranks use every unit the order is the one each rank's backward follows anyway, so reductions still overlap
backward; a unit a rank did not use holds the units after it back to the end of that rank's backward.
Whether a parameter is stepped is agreed separately, per optimizer step (see [Note: unused parameters]).

[Note: gradients held on the module]
Stages 2 and 3 reduce every backward (the stage's rule: the full gradients are freed after each one). Gradient
accumulation frameworks ask to skip that for the micro-steps before the last (Fabric's ``no_backward_sync``, DDP's
``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``). While :attr:`GradientSync.HELD`, a backward reduces
nothing: each parameter's gradient stays on the module, full size, accumulating over the held backwards as stage 1
keeps it (under bf16/fp16 in the fp32 stash, so accumulation never happens in the low precision). The next backward
outside the hold adds its gradients to them and reduces the sum, once; a step taken right after a held backward
reduces them at the step, as stage 1 does. What the hold cannot skip: stage 3's parameter gathers in forward and
backward (every rank holds only its slice of the parameters), and the memory of the full gradients (DDP's, held
until the reduction). Stage 1 never reduces in backward, so there the hold changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum, auto

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.runtime.owned_hook import OwnedHook
from zero_strategy.core.runtime.reduction_order import ReductionOrder
from zero_strategy.core.runtime.unit import ZeroUnit
from zero_strategy.core.stage import ZeroStage


class GradientSync(Enum):
    """What a backward does with the gradients it produces (see [Note: gradients held on the module])."""

    REDUCED = auto()  # the stage's rule: stages 2/3 reduce every backward, stage 1 at the step
    HELD = auto()  # stages 2/3 too keep them on the module (full size) until a backward outside the hold, or the step


class BackwardReductions:
    """Starts each unit's reduction during backward, in the agreed order, and finishes them at its end; or holds
    the gradients on the module while :attr:`sync` is HELD."""

    def __init__(self, units: list[ZeroUnit], stage: ZeroStage, order: ReductionOrder,
                 on_first_gradient: Callable[[], None]) -> None:
        """``on_first_gradient``: called as each gradient lands (it queues the end-of-backward callback)."""
        self.units = units
        self.stage = stage
        self.order = order
        self.on_first_gradient = on_first_gradient
        self.sync = GradientSync.REDUCED
        self.pending_held = False  # a held backward left gradients on the module that no reduction took yet
        self._reducing: list[ZeroUnit] = []  # units whose reduce-scatters are in flight, in start order

    def install(self) -> list[RemovableHandle]:
        """Stages 2/3: a hook on every trainable parameter; stage 1: the fp32 stash under mixed precision."""
        handles = []
        for u, unit in enumerate(self.units):
            for f, flat in enumerate(unit.flat_params):
                if not flat.trainable:
                    continue
                if self.stage.reduces_every_microstep:
                    handles += [param.register_post_accumulate_grad_hook(OwnedHook(self._grad_ready_at, u, f, i))
                                for i, param in enumerate(flat.params)]  # fmt: skip
                elif flat.full.dtype != torch.float32:
                    # stage 1 keeps gradients until the step; in low precision they go to an fp32 stash as they
                    # are produced, so accumulation over micro-steps happens in fp32, never in bf16/fp16
                    handles += [param.register_post_accumulate_grad_hook(OwnedHook(self._stash_at, u, f, i))
                                for i, param in enumerate(flat.params)]  # fmt: skip
                else:  # stage 1 in fp32: only the end of backward is needed (reads of p.grad learn of it there)
                    handles += [param.register_post_accumulate_grad_hook(OwnedHook(self._landed))
                                for param in flat.params]  # fmt: skip
        return handles

    # A parameter's hooks name their unit and FlatParam by position: torch holds them where the garbage collector
    # cannot see (see core/runtime/owned_hook.py), so they must not hold this object, a unit or its buffers.
    def _grad_ready_at(self, unit: int, flat: int, index: int, param: Tensor) -> None:
        self._on_grad_ready(self.units[unit], self.units[unit].flat_params[flat], index, param)

    def _stash_at(self, unit: int, flat: int, index: int, param: Tensor) -> None:
        self.on_first_gradient()
        self.units[unit].flat_params[flat].grads.stash_grad(index)

    def _landed(self, param: Tensor) -> None:
        self.on_first_gradient()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Backwards inside the block keep their gradients on the module (see [Note: gradients held on the
        module]). Every rank enters it around the same backwards."""
        previous, self.sync = self.sync, GradientSync.HELD
        try:
            yield
        finally:
            self.sync = previous

    # ------------------------------------------------------------------------------------------- backward
    def _on_grad_ready(self, unit: ZeroUnit, flat: FlatParam, index: int, param: Tensor) -> None:
        self.on_first_gradient()
        if self.sync is GradientSync.HELD:
            if flat.full.dtype != torch.float32:
                flat.grads.stash_grad(index)  # accumulated in fp32, as stage 1 does
            return
        unit.grads_ready += 1
        if unit.grads_ready < unit.expected_grads():
            return
        # Reductions start in the agreed order (see [Note: collective order]) and run while backward goes on.
        for ready in self.order.on_ready(unit):
            self._start_reduce(ready)
        # A unit with frozen parameters may still be needed by backward ops that produce no gradient for it
        # (a frozen layer earlier in the unit), and the root's parameters can be used anywhere: both wait.
        if self.stage.reshards_parameters and not unit.has_frozen and not unit.is_root:
            unit.reshard()

    def _start_reduce(self, unit: ZeroUnit) -> None:
        """Start ``unit``'s reduction on every rank's behalf: a FlatParam this rank has no gradient for sends zeros,
        because a peer may have one. Waiting first for the previous unit's reduction when it went through the
        network bounds the memory of flattened gradients in flight to two units (see [Note: overlapped
        reduction])."""
        if self._reducing and self._reducing[-1].reductions_in_flight() is not None:
            self._reducing.pop().finish_reduce()
        unit.start_reduce(force=_can_have_gradients)
        self._reducing.append(unit)

    def end_of_backward(self) -> None:
        """Every unit not reduced yet starts now (in the agreed sequence) and every reduction finishes; nothing
        when the backward held its gradients."""
        if self.sync is GradientSync.HELD:
            if self.stage.reduces_every_microstep:
                self.pending_held = True
            for unit in self.units:
                unit.grads_ready = 0
            return
        if self.stage.reduces_every_microstep:
            for unit in self.order.end_of_backward():
                self._start_reduce(unit)
        for unit in self._reducing:
            unit.finish_reduce()
        self._reducing = []
        if self.stage.reduces_every_microstep:
            self.order.settle()
            self.pending_held = False  # the sweep above reduced every trainable unit, held gradients included
        for unit in self.units:
            unit.grads_ready = 0


def _can_have_gradients(flat: FlatParam) -> bool:
    return flat.grads.requires_grad_now()
