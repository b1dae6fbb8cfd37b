"""The optimizer step as an explicit lifecycle, per optimizer: accumulate, reduce, step, publish.

[Note: the step window]
Each optimizer's step moves through three phases, and every call checks the phase it needs:

- ACCUMULATING: backward passes add gradients (stage 1 keeps them on the module; stages 2/3 reduce each backward's
  into the master pieces). Nothing has been agreed this step.
- REDUCED: the ranks agreed, once, on which parameters some rank used (see [Note: unused parameters]), every pending
  gradient was reduced into the master pieces and, with hybrid sharding, averaged over the replicas. Unscaling,
  the overflow check, norms and clipping read the gradients here (manual optimization clips between backward and
  ``opt.step()``). A further backward's gradients are reduced when the next call asks.
- STEPPING: the elements no rank used are saved, and every rank is done reading the host-wide parameters (a barrier,
  see [Note: shared-memory gathers]): the optimizer may step the master pieces. Leaving it either publishes the new
  slices to the module's parameters (stages 1/2 re-gather them; stage 3 drops its gathered copies) behind the
  second barrier, or discards the step's gradients on every rank (a skipped fp16 step).

``zero_grad()`` (or a skipped step) returns the optimizer to ACCUMULATING from anywhere but STEPPING.

[Note: optimizers sharing parameters]
Several optimizers may step the same parameters (manual optimization alternating two optimizers over one layer; a
GAN whose generator's optimizer also covers a layer the discriminator's holds), as under DDP, where they share each
parameter's ``.grad``. Which state is shared and which is each optimizer's own:

- per FlatParam, shared like DDP's ``.grad`` (core/flat/grads.py): the gradient itself (pending on the module at
  stage 1, reduced into the master pieces), which parameters produced one since it was last cleared, the replica
  average, the fp16 unscaling. It is reduced once per backward (stages 2/3), or by the first window that needs it
  (stage 1), whichever optimizer's that is. A step does not consume it: an optimizer stepping after another without
  ``zero_grad()`` in between steps with the same gradient, which is not unscaled a second time (DDP: the same
  ``.grad``). ``zero_grad()`` of any optimizer that steps the FlatParam, or a skipped step, clears it for all of
  them (DDP: ``.grad = None`` for everyone).
- per optimizer (an :class:`OptimizerStep`): the phase, the agreed overflow answer of its step, the unused
  elements it put aside, and its optimizer state: each optimizer lists the same master piece objects in its param
  groups (pieces are cut wherever any optimizer's group changes) and torch keys its state by those objects. When a
  FlatParam's gradient is cleared, every other optimizer stepping it that had agreed on it (REDUCED) goes back to
  ACCUMULATING: what it agreed on is gone, and its next step agrees again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum, auto
from functools import partial
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.core.comm.engine_comms import EngineComms
from zero_strategy.core.engine import gradients
from zero_strategy.core.engine.chunked_step import chunked_step
from zero_strategy.core.engine.ddp_gradients import DdpGradients
from zero_strategy.core.engine.hybrid import average_over_replicas
from zero_strategy.core.engine.unused import Saved, agree_on_used, protect_unused, restore_unused
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.in_place_watch import OVERWRITTEN
from zero_strategy.core.flat.placement import Placement
from zero_strategy.core.runtime.unit import ZeroUnit
from zero_strategy.core.stage import ZeroStage


class StepPhase(Enum):
    """Where one optimizer's step stands (see [Note: the step window])."""

    ACCUMULATING = auto()
    REDUCED = auto()
    STEPPING = auto()


class StepOrderError(RuntimeError):
    """A step call came in the wrong phase (e.g. ``step`` outside the window, or the window entered twice)."""


@dataclass(slots=True)
class OptimizerStep:
    """One optimizer's step in progress."""

    phase: StepPhase = StepPhase.ACCUMULATING
    overflow: bool | None = None  # fp16: the agreed answer of this step's overflow check, once unscaled
    saved_unused: Saved = field(default_factory=list)  # elements no rank used, put back after the step


class StepWindow:
    """One optimizer step in progress (see :meth:`ZeroEngine.step_window`)."""

    def __init__(self) -> None:
        self.skipped = False

    def skip(self) -> None:
        """Leave the window without stepping: every rank drops this step's gradients."""
        self.skipped = True


class StepWindows:
    """The step lifecycle of every optimizer of one engine (see [Note: the step window])."""

    def __init__(
        self, units: list[ZeroUnit], stage: ZeroStage, comms: EngineComms, placement: Placement | None,
        chunk_numel: int, optimizers: list[Optimizer], gradients_held: Callable[[], bool] = lambda: False,
    ) -> None:
        """``gradients_held``: whether a backward left gradients on the module that no reduction took yet (see
        [Note: gradients held on the module] in runtime/backward_reductions.py)."""
        self.units = units
        self.stage = stage
        self.comms = comms
        self.placement = placement
        self.chunk_numel = chunk_numel
        self.optimizers = optimizers
        self.steps = [OptimizerStep() for _ in optimizers]
        self.gradients_held = gradients_held
        # the copies reads of p.grad returned; users' edits of them go into the slices before the slices are read
        # (see [Note: p.grad as under DDP] in ddp_gradients.py). Set by the engine.
        self.gradient_reads: DdpGradients | None = None
        # per optimizer, the other optimizers that step one of its FlatParams
        self.sharing: list[set[int]] = [set() for _ in optimizers]
        for flat in self.flats_of(None):
            for index in flat.optimizers:
                self.sharing[index].update(other for other in flat.optimizers if other != index)

    def flats_of(self, index: int | None) -> Iterator[FlatParam]:
        """The FlatParams optimizer ``index`` steps (every FlatParam for None)."""
        for unit in self.units:
            for flat in unit.flat_params:
                if index is None or index in flat.optimizers:
                    yield flat

    def pieces_of(self, index: int) -> list[nn.Parameter]:
        return [piece for flat in self.flats_of(index) for piece in flat.master_pieces]

    def _expect(self, index: int, *phases: StepPhase, doing: str) -> OptimizerStep:
        step = self.steps[index]
        if step.phase not in phases:
            raise StepOrderError(
                f"ZeRO: cannot {doing} while optimizer {index} ({type(self.optimizers[index]).__name__}) is "
                f"{step.phase.name} (see [Note: the step window]): step through engine.step_window(optimizer) "
                "(Lightning: opt.step() / the precision plugin), once per step."
            )
        return step

    # ------------------------------------------------------------------------------------ ACCUMULATING → REDUCED
    def reduce(self, index: int, advance: bool = True) -> None:
        """Bring every gradient of optimizer ``index`` produced so far onto its master pieces (see the Note).
        ``advance=False`` (reading the gradients outside the step: per-parameter norms) leaves an ACCUMULATING
        optimizer ACCUMULATING, so its step agrees again on what later backward passes add. Collective: every
        rank calls it at the same point."""
        if self.gradient_reads is not None:
            self.gradient_reads.take_edits()
        step = self.steps[index]
        force: Callable[[FlatParam], bool] | None = None
        if step.phase is StepPhase.ACCUMULATING:
            flats = list(self.flats_of(index))
            # stage 1 (and stages 2/3 after a backward that held its gradients on the module, see [Note: gradients
            # held on the module]): they wait on the module
            holds_gradients = not self.stage.reduces_every_microstep or self.gradients_held()
            # a parameter used in one shard group is reduced over its replicas: the agreement spans every rank
            pending = agree_on_used(flats, self.comms.everyone, with_pending=holds_gradients)
            if advance:
                self.comms.shard.verify_step()
                step.phase = StepPhase.REDUCED
            if holds_gradients:
                # every rank reduces every FlatParam some rank holds gradients for (zeros where it has none), so
                # the ranks issue the same reductions
                reduced = {id(flat) for flat, flag in zip(flats, pending, strict=True) if flag}
                force = partial(_listed, reduced)
        # All units' reductions are posted before the first wait: stage 1 holds every full gradient anyway, and
        # flattening releases the `.grad` it copies, so this costs no memory and lets the exchanges overlap.
        for unit in self.units:
            unit.start_reduce(index, force=force)
        for unit in self.units:
            unit.finish_reduce()
        flats = list(self.flats_of(index))
        for flat in flats:
            flat.grads.settle_host_copies()  # offload on a GPU: the host reads the gradients next
        replicas = self.comms.replicas
        if replicas is not None and replicas.count > 1:  # hybrid sharding: once per step (see [Note: hybrid sharding])
            for flat in flats:
                average_over_replicas(flat, replicas)

    # ------------------------------------------------------------------------------------- reading the gradients
    def grad_norm(self, index: int, norm_type: float) -> Tensor:
        self.reduce(index)
        return gradients.global_grad_norm(self.pieces_of(index), self.comms.shard, norm_type, self._across(index))

    def clip_grad_norm(self, index: int, max_norm: float, norm_type: float) -> Tensor:
        self.reduce(index)
        self._changing(index)
        return gradients.clip_by_global_norm(self.pieces_of(index), self.comms.shard, max_norm, norm_type,
                                             self._across(index))

    def clip_grad_value(self, index: int, clip_value: float) -> None:
        self.reduce(index)
        self._changing(index)
        gradients.clip_by_value(self.pieces_of(index), clip_value)

    def _across(self, index: int) -> gradients.AcrossTensorParallel | None:
        """With tensor parallelism, how optimizer ``index``'s norm crosses the tensor-parallel group."""
        return gradients.AcrossTensorParallel.of(self.flats_of(index), self.comms.tensor)

    def _changing(self, index: int) -> None:
        """Optimizer ``index``'s gradients are about to change here (clipping): copies made for reads are stale."""
        for flat in self.flats_of(index):
            flat.grads.changed()

    def unscale_and_check_overflow(self, index: int, inv_scale: float) -> bool:
        """Once per step (see ZeroEngine.unscale_and_check_overflow); each FlatParam's gradient is unscaled once,
        whichever of its optimizers asks first (see [Note: optimizers sharing parameters])."""
        step = self.steps[index]
        if step.overflow is None:
            self.reduce(index)
            for flat in self.flats_of(index):
                flat.grads.unscale(inv_scale)
            step.overflow = gradients.find_overflow(self.pieces_of(index), self.comms.shard, self.comms.tensor)
        return step.overflow

    def parameter_grad_norms(self, params: list[nn.Parameter], norm_type: float) -> list[Tensor | None]:
        """Per parameter, the norm of its gradient averaged over the ranks (None: no rank produced one since it was
        last cleared, or no optimizer steps it). Collective (see ZeroEngine.parameter_grad_norms)."""
        where = {id(p): (flat, i) for flat in self.flats_of(None) if flat.trainable for i, p in enumerate(flat.params)}
        located = [where.get(id(param)) for param in params]
        for index in sorted({o for entry in located if entry is not None for o in entry[0].optimizers}):
            self.reduce(index, advance=False)
        across = gradients.AcrossTensorParallel.of(self.flats_of(None), self.comms.tensor)
        return gradients.parameter_grad_norms(located, self.comms.shard, norm_type, across)

    def first_nonfinite_param(self, index: int) -> str | None:
        return gradients.first_nonfinite_parameter(self.flats_of(index), self.comms.shard)

    # ---------------------------------------------------------------------------------------------- stepping
    def enter(self, index: int) -> None:
        """→ STEPPING: gradients reduced, unused elements saved, peers done reading our host-wide slices."""
        self._expect(index, StepPhase.ACCUMULATING, StepPhase.REDUCED, doing="enter the step window")
        self.reduce(index)
        # parameters that produced no gradient on any rank must not move
        self.steps[index].saved_unused = protect_unused(self.flats_of(index), self.optimizers[index])
        self.barrier_for_host_wide_parameters("before the optimizer step")
        self.steps[index].phase = StepPhase.STEPPING

    def step(self, index: int, **kwargs: Any) -> Any:
        """Step the user's optimizer on the master slices (in chunks when they live in files)."""
        self._expect(index, StepPhase.STEPPING, doing="step the optimizer")
        optimizer = self.optimizers[index]
        if self.gradient_reads is not None:  # the optimizer's own memory peaks now: the copies for reads go
            self.gradient_reads.drop()
        if self.placement is not None and self.placement.store is not None:
            chunked_step(optimizer, self.chunk_numel, self.placement.store)
            return None
        return optimizer.step(**kwargs)

    def publish(self, index: int) -> None:
        """STEPPING → ACCUMULATING: the updated slices reach the module's parameters (stages 1/2 gather them;
        stage 3 only drops any gathered copy so the next forward gathers the new values)."""
        step = self._expect(index, StepPhase.STEPPING, doing="publish the step")
        restore_unused(step.saved_unused)
        works = []
        for flat in self.flats_of(index):  # the gradients stay until zero_grad(), as torch leaves them
            if flat.keeps_full and not flat.storage.shard_aliases_full:  # the masters overwrite the parameters next
                flat.in_place.check(OVERWRITTEN)  # see [Note: in-place changes outside the optimizer]
            flat.storage.refresh_device_source()
            works.append(flat.start_publish())  # all gathers are posted before the first wait
        for work in works:
            work.wait()
        self.barrier_for_host_wide_parameters("after the optimizer step")  # our slices complete before peers read
        self.steps[index] = OptimizerStep()

    def discard(self, index: int) -> None:
        """Any phase → ACCUMULATING, dropping every gradient of optimizer ``index`` (a skipped step changes
        nothing; ``zero_grad``) — for every optimizer that steps one of its FlatParams too (see [Note: optimizers
        sharing parameters])."""
        for flat in self.flats_of(index):
            flat.grads.discard()
        self.steps[index] = OptimizerStep()
        for other in self.sharing[index]:
            if self.steps[other].phase is StepPhase.REDUCED:  # what it agreed on is gone
                self.steps[other] = OptimizerStep()

    def on_zero_grad(self, index: int) -> None:
        """See [Note: zero_grad reaches the module's gradients] in optimizer.py."""
        self._expect(index, StepPhase.ACCUMULATING, StepPhase.REDUCED, doing="zero_grad()")
        stepping = [other for other in self.sharing[index] if self.steps[other].phase is StepPhase.STEPPING]
        if stepping:
            raise StepOrderError(
                f"ZeRO: zero_grad() of optimizer {index} ({type(self.optimizers[index]).__name__}) would clear the "
                f"gradients optimizer {stepping[0]} is stepping (they share parameters); call it after that step."
            )
        self.discard(index)

    def barrier_for_host_wide_parameters(self, label: str) -> None:
        """One of the barriers of the write rule of host-wide parameters (see [Note: shared-memory gathers]); its
        waiting time is logged as blocked on "barrier". Nothing when the parameters are private."""
        if self.comms.host_shared:
            self.comms.shard.barrier(label).wait()


def _listed(flat_ids: set[int], flat: FlatParam) -> bool:
    return id(flat) in flat_ids
