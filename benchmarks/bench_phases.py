"""Where a step's time goes on the Trainer and Fabric paths: exclusive ("self") time per phase, measured by timers
around named functions of Lightning's loop, the precision plugins and the engine, in one profiled run per method.

[Note: self time per phase]
Each timed function records its inclusive time minus the inclusive time of the timed functions it called, and books
the rest under its own label; time outside every timed function (the loop's own lines between the calls) is booked
under ``OUTSIDE``. So the phases of one step add up to the step, nothing is counted twice, and a phase is the work
of that function itself (``strategy hook: training_step`` is Lightning's dispatch and the precision plugin's
context around the user's code, not the forward, which is booked under ``compute: forward``). The profiled run is
separate from the timed repetitions (a timer costs a few microseconds per call, a few hundred calls per step), and
its figures are read as a breakdown of one run, not as the step time of the tables. A timer's own cost lands in
its caller's self time, so a phase that makes many timed calls (a dispatcher, a loop's own lines) reads a few
microseconds per call high. Each phase is read on two clocks: the wall clock, and the rank's CPU time
(``time.thread_time``), which a loaded machine inflates far less (a rank waiting in a collective for its peer, or
descheduled, uses no CPU).

Lightning's hook calls are timed at its three dispatchers (``trainer/call.py``), labelled by hook name, so every
hook a step runs is a phase of its own without timing the user's hook methods themselves: wrapping those would make
Lightning (and ZeRO's gradient-read check, which looks for overridden gradient hooks) see them as overridden.
"""

from __future__ import annotations

import functools
import importlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

OUTSIDE = "loop: outside every timed function"
ENGINE_AND_COMPUTE = ("compute:", "engine:")  # the phases an engine-level row runs too


class PhaseClock:
    """Self time per label of the functions it wraps, in this (forked, per-run) process; see [Note: self time per
    phase]."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # wall-clock self time
        self.cpu_seconds: dict[str, float] = defaultdict(float)  # this thread's CPU self time
        self.counts: dict[str, int] = defaultdict(int)
        # per open timed call: the (wall, CPU) inclusive time of the timed calls it made
        self._children: list[list[float]] = []
        self._originals: list[tuple[Any, str, Any]] = []
        self._started: tuple[float, float] | None = None  # both clocks at start(): the rest is OUTSIDE
        self.recording = False

    def wrap(self, owner: Any, name: str, label: str | Callable[..., str]) -> None:
        """Time ``owner.name`` (a class's method, a module's function) under ``label``, or under ``label(*args)``
        for a dispatcher whose label depends on its arguments (the hook's name)."""
        # a class's own attribute (a method it inherits is shadowed on it, and the shadow deleted again)
        own = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        if isinstance(own, (staticmethod, classmethod)):
            raise TypeError(f"{owner}.{name}: static and class methods are not timed")
        self._originals.append((owner, name, own))
        setattr(owner, name, self._timed(getattr(owner, name) if own is None else own, label))

    def _timed(self, original: Callable[..., Any], label: str | Callable[..., str]) -> Callable[..., Any]:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                return original(*args, **kwargs)
            self._children.append([0.0, 0.0])
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                inclusive, inclusive_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                children, children_cpu = self._children.pop()
                name = label if isinstance(label, str) else label(*args, **kwargs)
                self.seconds[name] += inclusive - children
                self.cpu_seconds[name] += inclusive_cpu - children_cpu
                self.counts[name] += 1
                if self._children:
                    self._children[-1][0] += inclusive
                    self._children[-1][1] += inclusive_cpu

        return timed

    def start(self) -> None:
        """Record from now on (the timed steps begin)."""
        self.seconds.clear()
        self.cpu_seconds.clear()
        self.counts.clear()
        self.recording = True
        self._started = (time.perf_counter(), time.thread_time())

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop recording; the wall and CPU seconds per label, with the time outside every timed call under
        ``OUTSIDE``: ``{"wall": {label: s}, "cpu": {label: s}}``."""
        assert self._started is not None, "PhaseClock.stop() before start()"
        self.recording = False
        total, total_cpu = time.perf_counter() - self._started[0], time.thread_time() - self._started[1]
        self.seconds[OUTSIDE] += total - sum(self.seconds.values())
        self.cpu_seconds[OUTSIDE] += total_cpu - sum(self.cpu_seconds.values())
        return {"wall": dict(self.seconds), "cpu": dict(self.cpu_seconds)}

    def remove(self) -> None:
        for owner, name, original in reversed(self._originals):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()


def _hook_label(kind: str) -> Callable[..., str]:
    def label(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> str:
        return f"{kind} hook: {hook_name}"

    return label


def install_lightning_timers(clock: PhaseClock) -> None:
    """Time the Trainer loop's phases (see the module docstring). Imports happen here: only a Lightning row pays."""
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.loops.optimization.automatic import Closure, _AutomaticOptimization
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    clock.wrap(call, "_call_callback_hooks", _hook_label("callback"))
    clock.wrap(call, "_call_lightning_module_hook", _hook_label("LightningModule"))
    clock.wrap(call, "_call_strategy_hook", _hook_label("strategy"))
    for name in ("on_batch_start", "on_batch_end", "update_train_step_metrics"):
        clock.wrap(_LoggerConnector, name, f"logging: _LoggerConnector.{name}")
    clock.wrap(_TrainingEpochLoop, "_broadcast_sigterm_tensor", "loop: SIGTERM flag broadcast (Lightning, world > 1)")
    clock.wrap(_TrainingEpochLoop, "update_lr_schedulers", "loop: update_lr_schedulers")
    clock.wrap(_TrainingEpochLoop, "advance", "loop: _TrainingEpochLoop.advance (own lines)")
    clock.wrap(_TrainingEpochLoop, "on_advance_end", "loop: _TrainingEpochLoop.on_advance_end")
    clock.wrap(_AutomaticOptimization, "run", "loop: _AutomaticOptimization.run (own lines)")
    clock.wrap(Closure, "__call__", "loop: Closure.__call__ (own lines)")
    clock.wrap(LightningOptimizer, "step", "loop: LightningOptimizer.step (own lines)")
    clock.wrap(_PrefetchDataFetcher, "__next__", "loop: data fetch")


def install_fabric_timers(clock: PhaseClock) -> None:
    """Time Fabric's wrappers around the user's calls."""
    from lightning.fabric.fabric import Fabric
    from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer

    clock.wrap(Fabric, "backward", "fabric: Fabric.backward (own lines)")
    clock.wrap(_FabricModule, "forward", "fabric: _FabricModule.forward (own lines)")
    clock.wrap(_FabricOptimizer, "step", "fabric: _FabricOptimizer.step (own lines)")


def install_adapter_timers(clock: PhaseClock) -> None:
    """Time the ZeRO adapters' precision plugins and the engine's phases (the engine-level rows run these too)."""
    import torch

    from zero_strategy.core.engine.engine import ZeroEngine
    from zero_strategy.core.engine.window import StepWindows
    from zero_strategy.core.runtime.backward_reductions import BackwardReductions
    from zero_strategy.core.runtime.hooks import RuntimeHooks
    from zero_strategy.fabric.precision import ZeroFabricPrecision
    from zero_strategy.lightning.precision import ZeroPrecision

    clock.wrap(torch.Tensor, "backward", "compute: backward (autograd, with ZeRO's backward hooks)")
    clock.wrap(torch.optim.AdamW, "step", "compute: AdamW.step (torch; ZeRO's fused step on its slices too)")
    clock.wrap(ZeroPrecision, "optimizer_step", "ZeroPrecision.optimizer_step (own lines)")
    clock.wrap(ZeroPrecision, "pre_backward", "ZeroPrecision.pre_backward (own lines, on_before_backward)")
    clock.wrap(ZeroPrecision, "post_backward", "ZeroPrecision.post_backward (own lines, on_after_backward)")
    # the gradient-read check before Lightning's gradient hooks: its name before and after issue 34
    for name in ("_watching_grad_reads", "_gather_for_gradient_hooks"):
        if hasattr(ZeroPrecision, name):
            clock.wrap(ZeroPrecision, name, f"gradient-read check: ZeroPrecision.{name}")
    clock.wrap(ZeroPrecision, "_after_closure", "ZeroPrecision._after_closure (on_before_optimizer_step, clipping)")
    clock.wrap(ZeroFabricPrecision, "optimizer_step", "ZeroFabricPrecision.optimizer_step (own lines)")
    clock.wrap(ZeroFabricPrecision, "backward", "ZeroFabricPrecision.backward (own lines)")
    clock.wrap(ZeroEngine, "_before_root_forward", "engine: before the root forward (buffer broadcast, own lines)")
    # the bookkeeping behind DDP's semantics for reads of p.grad (issue 34), where the engine has it
    wrap_if_present(clock, "zero_strategy.core.engine.ddp_gradients", "DdpGradients",
                    ("before_forward", "after_backward", "gather_now"), "engine: p.grad reads as under DDP")
    # the unit hooks: bound when the engine installs them, which is after these timers are (rank_worker)
    for name in ("_pre_root_forward", "_post_root_forward", "_pre_forward", "_post_forward"):
        clock.wrap(RuntimeHooks, name, "engine: forward hooks (gather, free)")
    for name in ("_pre_backward", "_end_of_backward"):
        clock.wrap(RuntimeHooks, name, "engine: backward hooks (gather, end of backward)")
    clock.wrap(BackwardReductions, "_on_grad_ready", "engine: gradient-ready hooks (reduce-scatter)")
    clock.wrap(StepWindows, "enter", "engine: step window entry (agree on used, reduce)")
    clock.wrap(StepWindows, "step", "engine: optimizer step on the slices")
    clock.wrap(StepWindows, "publish", "engine: publish (gather / barriers)")
    clock.wrap(StepWindows, "on_zero_grad", "engine: zero_grad")


def wrap_if_present(clock: PhaseClock, module_name: str, class_name: str, names: Sequence[str], label: str) -> None:
    """Time ``names`` of ``module_name.class_name`` where this version of the package has them (a benchmark of an
    older checkout still runs)."""
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return
    for name in names:
        if hasattr(owner, name):
            clock.wrap(owner, name, label)


def merge_phases(runs: Sequence[dict[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step of each phase: the median over the ranks' profiled runs (one clock's)."""
    labels = {label for run in runs for label in run}
    return {label: statistics.median(run.get(label, 0.0) for run in runs) * 1e3 / steps for label in labels}


@dataclass(slots=True)
class Phases:
    """One method's breakdown: milliseconds per step by phase, wall clock and this rank's CPU."""

    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)


def merge_runs(runs: Sequence[dict[str, dict[str, float]]], steps: int) -> Phases:
    """The ranks' ``PhaseClock.stop()`` results as one :class:`Phases` (medians over the ranks)."""
    return Phases(merge_phases([run["wall"] for run in runs], steps), merge_phases([run["cpu"] for run in runs], steps))


def _cell(phases: Phases, label: str) -> str:
    if label not in phases.wall:
        return "—"
    return f"{phases.wall[label]:.2f} ({phases.cpu.get(label, 0.0):.2f})"


def _sum_cell(phases: Phases, keep: Callable[[str], bool]) -> str:
    wall = sum(ms for label, ms in phases.wall.items() if keep(label))
    cpu = sum(ms for label, ms in phases.cpu.items() if keep(label))
    return f"**{wall:.2f} ({cpu:.2f})**"


def breakdown_table(phases: dict[str, Phases], engine_ms: dict[str, float]) -> list[str]:
    """Markdown lines: one column per profiled method, one row per phase (ms per step of self time, wall clock and
    in parentheses CPU), largest first; then the work beyond compute and engine, each method's profiled total and,
    where the same run timed it, the engine-level row's median step."""
    if not phases:
        return []
    methods = list(phases)
    labels = sorted({label for table in phases.values() for label in table.wall},
                    key=lambda label: -max(table.wall.get(label, 0.0) for table in phases.values()))
    lines = [
        "Where each step's time goes (one profiled run per method after the timed ones; self time per phase in ms "
        "per step, wall clock and, in parentheses, the rank's CPU time, which a loaded machine inflates less; median "
        "over the ranks; see [Note: self time per phase] in benchmarks/bench_phases.py):",
        "",
        "| phase | " + " | ".join(methods) + " |",
        "|" + "---|" * (len(methods) + 1),
    ]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(_cell(phases[m], label) for m in methods) + " |")
    beyond = [_sum_cell(phases[m], lambda label: not label.startswith(ENGINE_AND_COMPUTE)) for m in methods]
    lines.append("| **beyond compute and engine (every phase but `compute:` and `engine:`)** | "
                 + " | ".join(beyond) + " |")
    totals = [_sum_cell(phases[m], lambda label: True) for m in methods]
    lines.append("| **profiled step (sum of the phases)** | " + " | ".join(totals) + " |")
    engine_cells = [f"{engine_ms[m]:.2f}" if m in engine_ms else "—" for m in methods]
    lines.append("| engine-level row of the same stage, median step (timed reps) | " + " | ".join(engine_cells) + " |")
    return lines
