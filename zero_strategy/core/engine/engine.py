"""ZeroEngine: shards one module across the data-parallel ranks and steps the user's optimizers on slices.

Communication plan of one optimizer step (Ψ parameters, N ranks):
- stage 1: nothing during the micro-steps; at the step, per unit, one reduce-scatter of the accumulated full
  gradients (Ψ) and, after the slice update, one all-gather of the updated parameters (Ψ).
- stage 2: each unit is reduce-scattered as its backward completes (Ψ per micro-step); the all-gather after the
  step as in stage 1 (Ψ).
- stage 3: a unit is all-gathered before its forward (Ψ) and again before its backward (Ψ), and reduce-scattered
  after it (Ψ per micro-step); nothing is gathered after the step — the next forward gathers the new values.
  Hierarchical (``hierarchical_params``): only a unit's first gather after a step crosses the world; the others
  gather the node-local secondary copies (see core/flat/secondary.py).
- hybrid sharding (``shard_group_size``): the above inside each shard group, then one all-reduce of the
  accumulated gradient slice over the replicas per step (see [Note: hybrid sharding] in plan/topology.py).
Global-norm clipping adds one scalar all-reduce. How the bytes travel is EngineComms' (core/comm/engine_comms.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.config import ZeroConfig
from zero_strategy.core.comm.group import simulated_group
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.engine.buffers import broadcast_buffers
from zero_strategy.core.engine.build import build_parts
from zero_strategy.core.engine.ddp_gradients import DdpGradients
from zero_strategy.core.engine.fused_steps import install_fused_steps, remove_fused_steps
from zero_strategy.core.engine.in_place_changes import take_in_place_changes
from zero_strategy.core.engine.optimizer import bind_optimizer, remove_zero_grad_hook
from zero_strategy.core.engine.release import gather_into_module, leave_sharded
from zero_strategy.core.engine.state_dict_hooks import StateDictGathers
from zero_strategy.core.engine.state_dict_loads import StateDictLoads
from zero_strategy.core.engine.window import StepWindow, StepWindows
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.grad_reads import replaying_writes
from zero_strategy.core.init.materialize import InitialValues
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.topology import RankLayout, resolve_rank_layout
from zero_strategy.core.runtime.hooks import RuntimeHooks
from zero_strategy.core.runtime.owned_hook import OwnedHook
from zero_strategy.core.runtime.reduction_order import ReductionOrder
from zero_strategy.core.stage import ZeroStage


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where this rank sits among the engine's ranks."""

    rank: int  # position in the shard group: which slice of every FlatParam it owns
    world_size: int  # ranks of the shard group
    replica_index: int = 0  # hybrid sharding: which shard group (0: the one that writes checkpoints)
    replica_count: int = 1


class EngineState(Enum):
    """Whether the engine drives the module."""

    SHARDING = auto()  # hooks installed: the module trains and evaluates sharded
    RELEASED = auto()  # hooks removed, comms closed; the slices (and the optimizers' state) are kept for a save


_LIVE_ENGINES: weakref.WeakSet[ZeroEngine] = weakref.WeakSet()  # engines sharding a module now (not released)


def engine_of(module: nn.Module) -> ZeroEngine | None:
    """The engine that shards ``module``'s parameters now (``module`` may be the sharded module or a part of it),
    or None."""
    wanted = {id(param) for param in module.parameters()}
    for engine in list(_LIVE_ENGINES):
        if engine.state is EngineState.SHARDING and wanted & engine.parameter_names().keys():
            return engine
    return None


class ZeroEngine:
    """Owns the units of one module, the hooks that drive them, and the binding of the user's optimizers."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        config: ZeroConfig,
        group: dist.ProcessGroup | RankLayout | None = None,
        entry_module: nn.Module | None = None,
        policy: MixedPrecisionPolicy | None = None,
        *,
        initial_values: InitialValues | None = None,
    ) -> None:
        """``entry_module``: where a step's forward enters (Lightning's wrapper); defaults to ``module``.
        ``policy``: mixed precision (compute dtype, reduction dtype); None computes in the parameters' dtype.
        ``initial_values``: how a meta-built module gets its values, and pretrained weights to load (see
        [Note: sharded construction] in core/init/materialize.py).
        ``group``: the process group to shard over, or a :class:`RankLayout` (nodes, shard and replica groups)."""
        self.module = module
        self.optimizers = list(optimizers)
        self.config = config
        self.stage = ZeroStage(config.stage)
        if group is None:  # ranks simulated by threads (logic tests: comm/in_process.py) shard over their world
            group = simulated_group()
        parts = build_parts(module, self.optimizers, config, resolve_rank_layout(group, config), policy,
                            initial_values)
        self.units, self.comms, self.placement = parts.units, parts.comms, parts.placement
        self.built_sharded, self.replay_stats = parts.built_sharded, parts.replay_stats
        replicas = self.comms.replicas
        self.place = RankPlace(self.comms.group.rank, self.comms.group.size,
                               replicas.index if replicas else 0, replicas.count if replicas else 1)
        # stop the comms' threads with the engine even if it is never released
        self._closer = weakref.finalize(self, self.comms.close)
        self.windows = StepWindows(self.units, self.stage, self.comms, self.placement, config.nvme_chunk_numel,
                                   self.optimizers, lambda: self.hooks.reductions.pending_held)
        loaded = initial_values is not None and initial_values.pretrained is not None
        if loaded or (parts.replay_stats is not None and self.comms.host_shared):
            self.after_load()  # loaded or replayed slices reach the module (and the host's buffers) before use
        self._sync_buffers()
        for index, optimizer in enumerate(self.optimizers):
            flats = list(self.windows.flats_of(index))
            bind_optimizer(optimizer, index, flats, OwnedHook(self.windows.on_zero_grad, index))
            install_fused_steps(optimizer, config.fused_optimizer)
        self.state = EngineState.SHARDING
        self._released_full = False  # what the release left in the module (returned again by a second release)
        # one order for the whole run, agreed by every rank (the replicas' shard groups reduce in the same order)
        order = ReductionOrder(self.units, self.comms.everyone)
        # reads of p.grad return DDP's values (see [Note: p.grad as under DDP] in ddp_gradients.py)
        self.gradient_reads = DdpGradients(self.flat_params, self._reduce_all_pending,
                                           self.stage.reduces_every_microstep, self.comms.everyone.size == 1,
                                           entered_elsewhere=None if entry_module is None else (module, entry_module))
        self.windows.gradient_reads = self.gradient_reads
        self.hooks = RuntimeHooks(self.units, self.stage, entry_module or module, config.prefetch,
                                  self._before_root_forward, order, self.gradient_reads.after_backward,
                                  self.gradient_reads.after_forward)
        self.hooks.install()
        # stage 3: state_dict() gathers (see [Note: parameters outside forward] in core/flat/access.py)
        self.state_dict_gathers = StateDictGathers(module, self.flat_params) if self.stage.reshards_parameters else None
        # every stage: a full state dict loads into the master slices (see [Note: loading a full state dict into
        # the shards] in state_dict_loads.py)
        self.state_dict_loads = StateDictLoads(module, self.flat_params, self.before_load, self.after_load)
        for unit in self.units:
            unit.release_gathered()
        _LIVE_ENGINES.add(self)

    # ---------------------------------------------------------------------------------------------- what it holds
    @property
    def comm_log(self) -> CommunicationLog:
        """What this engine's exchanges moved (see [Note: counting bytes where they move] in comm/log.py)."""
        return self.comms.log

    @property
    def flat_params(self) -> list[FlatParam]:
        return [flat for unit in self.units for flat in unit.flat_params]

    def named_flat_params(self) -> Iterator[tuple[str, FlatParam, tuple[int, ...]]]:
        """(stable key, FlatParam, the optimizers that step it) for every FlatParam, in unit order (checkpoints use
        the key). Changes made in place since the last step reach the masters first: a save writes them."""
        take_in_place_changes(self.flat_params)  # see [Note: in-place changes outside the optimizer]
        for flat in self.flat_params:
            yield flat.spec.key, flat, flat.optimizers

    def parameter_names(self) -> dict[int, str]:
        """``id(param)`` → the canonical name under which checkpoints store it."""
        return {id(p): name for flat in self.flat_params for name, p in zip(flat.names, flat.params, strict=True)}

    def before_load(self) -> None:
        """Slices are about to be overwritten outside a step (a checkpoint or state dict load): on one host at stage 3
        every peer must be done reading our slice of the host-wide parameters first (see [Note: shared-memory
        gathers]). Collective; nothing when the parameters are private."""
        self.windows.barrier_for_host_wide_parameters("before a load")

    def after_load(self) -> None:
        """Slices were overwritten (checkpoint load, sharded construction): make the module reflect them again."""
        for flat in self.flat_params:
            flat.in_place.forget()  # the load replaces whatever was changed before it: nothing to warn about
        for work in [flat.start_publish() for flat in self.flat_params]:
            work.wait()
        self.windows.barrier_for_host_wide_parameters("checkpoint load")

    def _sync_buffers(self) -> None:
        """Adopt rank 0's buffers (DDP does this at wrap time; see ``broadcast_buffers`` for every forward)."""
        broadcast_buffers(self.module, self.comms.everyone)

    def _reduce_all_pending(self) -> None:
        for index in range(len(self.optimizers)):
            self.windows.reduce(index, advance=False)

    def _before_root_forward(self) -> None:
        self.gradient_reads.at_step_entry()
        if self.config.broadcast_buffers and self.comms.everyone.size > 1 and self.module.training:
            if torch.is_grad_enabled():
                self._sync_buffers()

    # ------------------------------------------------------------------------------------------ optimizer step
    def optimizer_index(self, optimizer: Optimizer) -> int:
        """The position of ``optimizer`` among the optimizers bound at construction. A wrapper that keeps the real
        optimizer in ``_optimizer`` (Lightning's ``LightningOptimizer``) stands for the optimizer it wraps."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        for index, candidate in enumerate(self.optimizers):
            if candidate is optimizer:
                return index
        raise ValueError(
            f"{type(optimizer).__name__} was not given to ZeRO when the model was sharded; only the optimizers "
            "returned by configure_optimizers (or passed to ZeroEngine) can be stepped or clipped."
        )

    def master_params(self, optimizer: Optimizer) -> list[nn.Parameter]:
        return self.windows.pieces_of(self.optimizer_index(optimizer))

    def reduce_pending(self, optimizer: Optimizer) -> None:
        """Bring the gradients of ``optimizer``'s parameters produced so far onto its master pieces (see [Note: the
        step window] in window.py). Collective (every rank calls it at the same point)."""
        self.windows.reduce(self.optimizer_index(optimizer))

    def grad_norm(self, optimizer: Optimizer, norm_type: float = 2.0) -> Tensor:
        """The norm of the full gradient across all ranks' slices (see core/engine/gradients.py). Collective."""
        return self.windows.grad_norm(self.optimizer_index(optimizer), norm_type)

    def parameter_grad_norms(self, params: list[nn.Parameter], norm_type: float = 2.0) -> list[Tensor | None]:
        """Per parameter of this module, the ``norm_type``-norm of its gradient averaged over every rank and
        accumulated since it was last cleared (what the step uses), or None where no rank produced one (or no
        optimizer steps it). Gradients still waiting on the module (stage 1) are reduced first, without ending any
        optimizer's accumulation. Collective: every rank passes the same parameters (see zero_strategy.grad_norm)."""
        return self.windows.parameter_grad_norms(params, norm_type)

    def gather_gradients_for_reads(self) -> None:
        """Make the copies that reads of ``p.grad`` return now, at a point every rank reaches (before Lightning's
        gradient hooks, where a read may happen on one rank only): see [Note: p.grad as under DDP]. Collective."""
        self.gradient_reads.gather_now()

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        return self.windows.clip_grad_norm(self.optimizer_index(optimizer), max_norm, norm_type)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        self.windows.clip_grad_value(self.optimizer_index(optimizer), clip_value)

    def unscale_and_check_overflow(self, optimizer: Optimizer, inv_scale: float) -> bool:
        """Multiply the reduced gradients by ``inv_scale`` and tell whether any rank saw an inf/NaN (collective:
        every rank gets the same answer, so every rank skips together).

        Once per step: manual optimization unscales when the user clips, before ``opt.step()`` asks again; the
        second call returns the first answer without unscaling twice. Clip after the last backward of a step:
        gradients reduced after the unscaling would stay scaled (as with torch's GradScaler.unscale_)."""
        return self.windows.unscale_and_check_overflow(self.optimizer_index(optimizer), inv_scale)

    def first_nonfinite_param(self, optimizer: Optimizer) -> str | None:
        """The first parameter (in flat order, lowest rank first) whose reduced gradient is not finite. Collective."""
        return self.windows.first_nonfinite_param(self.optimizer_index(optimizer))

    def discard_grads(self, optimizer: Optimizer) -> None:
        """Drop all gradients of ``optimizer``'s parameters (a skipped step changes nothing)."""
        self.windows.discard(self.optimizer_index(optimizer))

    @contextmanager
    def step_window(self, optimizer: Optimizer) -> Iterator[StepWindow]:
        """The one way through an optimizer step, in the order of the communication plan (see [Note: the step
        window]). On entry the reduced gradients are on ``optimizer``'s master pieces; inside, the caller may
        unscale, clip and inspect them, then steps (:meth:`step`). On exit the updated slices reach the module's
        parameters — unless :meth:`StepWindow.skip` was called (an fp16 overflow): then the gradients are dropped
        on every rank and nothing moves. An exception inside leaves the step unfinished and propagates."""
        index = self.optimizer_index(optimizer)
        take_in_place_changes(self.windows.flats_of(index))  # see [Note: in-place changes outside the optimizer]
        self.windows.enter(index)
        window = StepWindow()
        yield window
        if window.skipped:
            self.windows.discard(index)
        else:
            self.windows.publish(index)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """One whole optimizer step: ``with step_window(optimizer): step(optimizer)``."""
        with self.step_window(optimizer):
            return self.step(optimizer, **kwargs)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step the user's optimizer on the master slices, inside :meth:`step_window` (in chunks when they live in
        files)."""
        return self.windows.step(self.optimizer_index(optimizer), **kwargs)

    @contextmanager
    def gradients_held(self) -> Iterator[None]:
        """Backwards inside the block leave their gradients on the module instead of reducing them (gradient
        accumulation's micro-steps before the last; see [Note: gradients held on the module] in
        runtime/backward_reductions.py). Every rank enters it around the same backwards. Stage 1 never reduces in
        backward: nothing changes there."""
        with self.gradient_reads.window(), self.hooks.reductions.held():
            yield

    @contextmanager
    def accumulation_window(self, hold: bool) -> Iterator[None]:
        """Backwards inside the block are a framework's micro-batches before the last of an accumulation window
        (where DDP does not synchronize). ``hold``: keep their gradients on the module (:meth:`gradients_held`), so
        that reads of ``p.grad`` get this rank's own sum as under DDP; without it stages 2/3 reduce them as usual
        and such a read is an error (see [Note: p.grad as under DDP] in ddp_gradients.py)."""
        with self.gradients_held() if hold else self.gradient_reads.window():
            yield

    # ------------------------------------------------------------------------------------------------- access
    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Make every parameter of the module whole for the duration of the block (e.g. ``state_dict()``)."""
        for flat in self.flat_params:  # a change made inside is this rank's until the release takes it in
            flat.unshard_private()
        try:  # bf16/fp16 stage 3: a change made to a whole parameter inside is replayed on the masters (exact)
            with replaying_writes([flat for flat in self.flat_params if not flat.keeps_full]):
                yield
        finally:
            for unit in self.units:
                unit.release_gathered()

    def release(self, full: bool | None = None) -> bool:
        """Undo the sharding: remove the hooks and give the module standalone, up-to-date full parameters, or
        (``full=False``) leave them on the meta device with this engine's slices as the weights. ``None``: the
        config's ``full_params_after_fit``, whose default keeps a model built sharded at stage 3 sharded (see
        [Note: releasing a model built sharded] in release.py). Returns whether the parameters are full."""
        if self.state is EngineState.RELEASED:  # idempotent: the module is already as the first release left it
            return self._released_full
        if full is None:
            full = self.config.full_params_after_fit
        if full is None:
            full = not (self.built_sharded and self.stage.reshards_parameters)
        self.hooks.remove()
        self.gradient_reads.close()
        if self.state_dict_gathers is not None:
            self.state_dict_gathers.remove()
        self.state_dict_loads.remove()
        for optimizer in self.optimizers:
            remove_zero_grad_hook(optimizer)
            remove_fused_steps(optimizer)
        for flat in self.flat_params:
            for param in flat.params:
                param.grad = None
            if full:
                gather_into_module(flat)
            else:
                leave_sharded(flat)
        _LIVE_ENGINES.discard(self)
        self._closer()  # the comms' threads and shared mappings end with the engine's hold on the module
        self.state, self._released_full = EngineState.RELEASED, full
        if self.placement is not None and self.placement.store is not None:
            # the files are unlinked; their mappings (a sharded release's slices, the optimizer state) stay valid
            self.placement.store.close()
        return full
