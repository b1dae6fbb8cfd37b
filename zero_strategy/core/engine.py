"""ZeroEngine: shards one module across the data-parallel ranks and steps the user's optimizers on slices.

Communication plan of one optimizer step (Ψ parameters, N ranks):
- stage 1: nothing during the micro-steps; at the step, per unit, one reduce-scatter of the accumulated full
  gradients (Ψ) and, after the slice update, one all-gather of the updated parameters (Ψ).
- stage 2: each unit is reduce-scattered as its backward completes (Ψ per micro-step); the all-gather after the
  step as in stage 1 (Ψ).
- stage 3: a unit is all-gathered before its forward (Ψ) and again before its backward (Ψ), and reduce-scattered
  after it (Ψ per micro-step); nothing is gathered after the step — the next forward gathers the new values.
  Hierarchical (``hierarchical_params``): only a unit's first gather after a step crosses the world; the others
  gather the node-local secondary copies (see core/hierarchical.py).
- hybrid sharding (``shard_group_size``): the above inside each shard group, then one all-reduce of the
  accumulated gradient slice over the replicas per step (see [Note: hybrid sharding] in transport/topology.py).
Global-norm clipping adds one scalar all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.config import ZeroConfig
from zero_strategy.core import gradients
from zero_strategy.core.compile_check import warn_compiled_around_units
from zero_strategy.core.flat_param import FlatParam
from zero_strategy.core.hooks import RuntimeHooks
from zero_strategy.core.hybrid import adopt_first_replica, average_over_replicas
from zero_strategy.core.in_place_watch import OVERWRITTEN
from zero_strategy.core.materialize import (
    InitialValues,
    check_materializable,
    load_pretrained,
    plan_replay,
    replay_construction,
)
from zero_strategy.core.mixed_precision import MixedPrecisionPolicy
from zero_strategy.core.offload import chunked_step, make_placement
from zero_strategy.core.optimizer import (
    bind_optimizer,
    check_optimizer,
    install_fused_steps,
    param_group_index,
    remove_fused_steps,
    remove_zero_grad_hook,
)
from zero_strategy.core.reduction_order import ReductionOrder
from zero_strategy.core.release import gather_into_module, leave_sharded
from zero_strategy.core.sharding import choose_unit_modules, plan_units
from zero_strategy.core.stage import ZeroStage
from zero_strategy.core.transport.choice import (
    Transport,
    choose_gather_watch,
    choose_shared_exchange,
    choose_shared_shards,
    dist_context,
    rank_layout,
    shared_memory_unavailable,
)
from zero_strategy.core.transport.collectives import CommunicationLog, ProcessGroup, broadcast_flat
from zero_strategy.core.transport.streams import CollectiveStreams
from zero_strategy.core.transport.topology import RankLayout
from zero_strategy.core.unit import UnitOptions, ZeroUnit
from zero_strategy.core.unused import Saved, agree_on_used, protect_unused, restore_unused

T = TypeVar("T")


def _used_by_some_rank(flat: FlatParam) -> bool:
    return any(flat.grad_seen)


class StepWindow:
    """One optimizer step in progress (see :meth:`ZeroEngine.step_window`)."""

    def __init__(self) -> None:
        self.skipped = False

    def skip(self) -> None:
        """Leave the window without stepping: every rank drops this step's gradients."""
        self.skipped = True


class ZeroEngine:
    """Owns the units of one module, the hooks that drive them, and the binding of the user's optimizers."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        config: ZeroConfig,
        group: ProcessGroup | RankLayout = None,
        entry_module: nn.Module | None = None,
        policy: MixedPrecisionPolicy | None = None,
        *,
        initial_values: InitialValues | None = None,
    ) -> None:
        """``entry_module``: where a step's forward enters (Lightning's wrapper); defaults to ``module``.
        ``policy``: mixed precision (compute dtype, reduction dtype); None computes in the parameters' dtype.
        ``initial_values``: how a meta-built module gets its values, and pretrained weights to load (see
        [Note: sharded construction] in materialize.py).
        ``group``: the process group to shard over, or a :class:`RankLayout` (nodes, shard and replica groups)."""
        self.module = module
        self.optimizers = list(optimizers)
        self.config = config
        self.stage = ZeroStage(config.stage)
        layout = rank_layout(group, config)
        self.ctx = dist_context(layout, config.collectives)
        self.comm_log = CommunicationLog(topology=layout.topology)
        self._unused_saved: dict[int, Saved] = {}
        self._overflow_found: dict[int, bool] = {}  # optimizer index -> unscaled this step; did any rank overflow
        self._agreed: set[int] = set()  # optimizer indices whose used-parameter agreement this step is done
        for optimizer in self.optimizers:
            check_optimizer(optimizer, config.allow_untested_optimizer)
        materialize_on = check_materializable(module, initial_values)
        self.built_sharded = materialize_on is not None  # no rank held the whole model: see core/release.py
        # planned while the tensors are still meta: building the FlatParams gives them storage
        recording = initial_values.recording if initial_values is not None else None
        replay = plan_replay(module, recording) if recording is not None and materialize_on is not None else None
        self._build_units(module, policy, materialize_on)
        adopt_first_replica(self.flat_params, self.ctx, self.comm_log)  # replicas start from global rank 0
        self.watch = choose_gather_watch(self.ctx, self.stage.reshards_parameters, self.shared)
        self.transport = Transport(self.ctx, self.comm_log, self.shared, self.watch)
        trainable = [flat.reduce_bytes for flat in self.flat_params if flat.trainable]
        self.exchange = choose_shared_exchange(self.ctx, config, self._device, self.watch, trainable)
        for unit in self.units:
            for flat in unit.flat_params:
                flat.label, flat.watch, flat.exchange = unit.name or "<root>", self.watch, self.exchange
        self.replay_stats = replay_construction(module, self.flat_params, replay, self.transport) if replay else None
        if initial_values is not None and initial_values.pretrained is not None:
            load_pretrained(module, self.flat_params, initial_values.pretrained, self.ctx.rank)
            self.after_load()
        elif replay is not None and self.shared is not None:
            self.after_load()  # the replayed slices reach the node's buffers before any peer reads them
        self._sync_buffers()
        self._repoint_optimizers()
        # one order for the whole run, agreed by every rank (the replicas' shard groups reduce in the same order)
        order = ReductionOrder(self.units, self.ctx.everyone, self.ctx.everyone_src, self._collective)
        self.hooks = RuntimeHooks(
            self.units, self.stage, entry_module or module, config.prefetch, self._before_root_forward, order
        )
        self.hooks.install()
        for unit in self.units:
            unit.release_gathered()

    # --------------------------------------------------------------------------------------------- set-up
    def _build_units(
        self, module: nn.Module, policy: MixedPrecisionPolicy | None, meta_to: torch.device | None
    ) -> None:
        """Plan the units from the module's shapes and give each its FlatParams (``meta_to``: where meta
        parameters get storage; None when the module is already real)."""
        config = self.config
        owner = param_group_index(self.optimizers)
        unit_paths = choose_unit_modules(module, config.unit_modules, config.min_unit_numel)
        plans = plan_units(module, unit_paths)
        if self.stage.reshards_parameters:  # stages 1/2 gather nothing during forward: nothing breaks a graph
            warn_compiled_around_units(module, unit_paths)
        device = meta_to or next((p.device for p in module.parameters()), torch.device("cpu"))
        self._device = device
        self.placement = make_placement(config, device, plans, self.ctx.rank)
        model_bytes = sum(p.numel() * p.element_size() for plan in plans for _, p in plan.named_params)  # all ranks
        self.shared = choose_shared_shards(self.ctx, config, self.placement is not None, device, model_bytes)
        self.streams = CollectiveStreams.for_device(device)  # CUDA: gather/reduce/copy side streams; else no-ops
        options = UnitOptions(
            not self.stage.reshards_parameters, policy, self.placement, self.shared, meta_to, self.streams
        )
        try:
            self.units = [ZeroUnit(plan, owner, self.ctx, self.comm_log, options) for plan in plans]
        except BaseException:
            if self.shared is not None:
                self.shared.discard_files()  # a failed set-up leaves nothing in /dev/shm
            raise
        if self.shared is not None and not self.shared.connect():
            for flat in self.flat_params:
                flat.leave_shared_memory()
            shared_memory_unavailable(config, self.shared.failure or "")

    def _collective(self, what: str, collective: Callable[[], T]) -> T:
        return self.transport.collective(what, collective)

    def _repoint_optimizers(self) -> None:
        for opt_index, optimizer in enumerate(self.optimizers):
            flats = list(self._flat_params_of(opt_index))
            bind_optimizer(optimizer, flats, self.ctx.rank, partial(self._on_zero_grad, opt_index))
            install_fused_steps(optimizer, self.config.fused_optimizer)

    def _on_zero_grad(self, optimizer_index: int) -> None:
        """See [Note: zero_grad reaches the module's gradients] in optimizer.py."""
        self._overflow_found.pop(optimizer_index, None)
        self._agreed.discard(optimizer_index)
        for flat in self._flat_params_of(optimizer_index):
            flat.discard_grads()

    def _flat_params_of(self, optimizer_index: int | None) -> Iterator[FlatParam]:
        for unit in self.units:
            for flat, index in zip(unit.flat_params, unit.optimizer_index, strict=True):
                if optimizer_index is None or index == optimizer_index:
                    yield flat

    @property
    def flat_params(self) -> list[FlatParam]:
        return list(self._flat_params_of(None))

    def named_flat_params(self) -> Iterator[tuple[str, FlatParam, int | None]]:
        """(stable key, FlatParam, optimizer index) for every FlatParam, in unit order (checkpoints use the key)."""
        for unit in self.units:
            for position, (flat, index) in enumerate(zip(unit.flat_params, unit.optimizer_index, strict=True)):
                yield f"{unit.name}/{position}", flat, index

    def parameter_names(self) -> dict[int, str]:
        """``id(param)`` → the canonical name under which checkpoints store it."""
        return {id(p): name for flat in self.flat_params for name, p in zip(flat.names, flat.params, strict=True)}

    def after_load(self) -> None:
        """Shards were overwritten (checkpoint load): make the module's parameters reflect them again."""
        for flat in self.flat_params:
            flat.in_place.forget()  # the load replaces whatever was changed before it: nothing to warn about
        for finish in [flat.start_publish_shard() for flat in self.flat_params]:
            finish()
        self._shared_write_barrier("checkpoint load")

    def _shared_write_barrier(self, label: str) -> None:
        """One of the barriers of the write rule of host-wide shared parameters (see [Note: shared-memory
        gathers]): through the reductions' shared counters where this host has them (a post and a spin, no system
        call), else the process group's barrier. Its waiting time is logged as blocked on "barrier"."""
        if self.shared is None:
            return
        if self.exchange is not None:
            self.exchange.barrier(self.comm_log, label)
            return
        with self.comm_log.blocking("barrier"):
            self.shared.barrier()

    def _sync_buffers(self) -> None:
        """Adopt rank 0's buffers (DDP does this at wrap time and, by default, before every forward)."""
        buffers = [b for b in self.module.buffers() if b.numel() > 0]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for buffer in buffers:
            by_dtype.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        for group in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in group])
            broadcast_flat(flat, self.ctx.everyone_src, self.ctx.everyone, self.comm_log)
            offset = 0
            with torch.no_grad():
                for buffer in group:
                    buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()

    def _before_root_forward(self) -> None:
        if self.config.broadcast_buffers and self.ctx.world_size > 1 and self.module.training:
            if torch.is_grad_enabled():
                self._collective("buffer broadcast", self._sync_buffers)

    # ------------------------------------------------------------------------------------ optimizer step
    def optimizer_index(self, optimizer: Optimizer) -> int:
        """The position of ``optimizer`` among the optimizers bound at construction. A wrapper that keeps the real
        optimizer in ``_optimizer`` (Lightning's ``LightningOptimizer``, what manual optimization hands the user)
        stands for the optimizer it wraps."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        for index, candidate in enumerate(self.optimizers):
            if candidate is optimizer:
                return index
        raise ValueError(
            f"{type(optimizer).__name__} was not given to ZeRO when the model was sharded; only the optimizers "
            "returned by configure_optimizers (or passed to ZeroEngine) can be stepped or clipped."
        )

    def master_params(self, optimizer: Optimizer) -> list[nn.Parameter]:
        index = self.optimizer_index(optimizer)
        return [piece for flat in self._flat_params_of(index) for piece in flat.master_pieces]

    def prepare_step(self, optimizer: Optimizer) -> None:
        """Make the reduced gradients of ``optimizer``'s parameters available on its master pieces.

        Stage 1 reduce-scatters here (the accumulation boundary); stages 2/3 already did during backward.
        """
        index = self.optimizer_index(optimizer)
        self.reduce_pending(optimizer)
        # parameters that produced no gradient on any rank must not move
        self._unused_saved[index] = protect_unused(self._flat_params_of(index), optimizer)
        self._shared_write_barrier("before the optimizer step")  # peers are done reading our shards

    def reduce_pending(self, optimizer: Optimizer) -> None:
        """Reduce-scatter ``optimizer``'s gradients that are still on the module (stage 1 keeps them there until
        the step) into its master pieces. ``prepare_step`` calls it, and so do clipping and the overflow check,
        because under manual optimization they run before the step (between backward and ``opt.step()``).
        Reducing releases the module's gradients, so a later call finds nothing left to send: the gradients are
        reduced exactly once per step. Collective (every rank calls it at the same point).

        The first call of a step agrees on which parameters some rank used (see [Note: unused parameters] in
        unused.py); at stage 1 every rank then reduces every FlatParam some rank used, with zeros where it has no
        gradient, so the ranks issue the same reductions. With hybrid sharding the slices accumulated since the
        last step are then averaged over the replicas, once per step (see [Note: hybrid sharding])."""
        index = self.optimizer_index(optimizer)
        force = None
        if index not in self._agreed:
            flats = list(self._flat_params_of(index))
            everyone = self.ctx.everyone  # a parameter used in one shard group is reduced over its replicas
            exchange = self.exchange if self.ctx.replicas is None else None  # it spans the shard group only
            self._collective(
                "agreement on used parameters", lambda: agree_on_used(flats, everyone, self.comm_log, exchange)
            )
            if self.watch is not None:
                self.watch.check_same_gathers(self.comm_log)
            self._agreed.add(index)
            force = None if self.stage.reduces_every_microstep else _used_by_some_rank
        # All units' reductions are posted before the first wait: stage 1 holds every full gradient anyway, and
        # flattening releases the `.grad` it copies, so this costs no memory and lets the exchanges overlap.
        for unit in self.units:
            unit.start_reduce(index, force=force)
        for unit in self.units:
            unit.finish_reduce()
        for flat in self._flat_params_of(index):
            flat.settle_host_grads()  # offload on a GPU: the host reads the gradients next
        averaging = [flat for flat in self._flat_params_of(index) if flat.replica_average_pending]
        if averaging:  # hybrid sharding: once per step, on the slices accumulated over the micro-steps

            def average() -> None:
                for flat in averaging:
                    average_over_replicas(flat)

            self._collective("replica all-reduce", average)

    def grad_norm(self, optimizer: Optimizer, norm_type: float = 2.0) -> Tensor:
        """The norm of the full gradient across all ranks' slices (see core/gradients.py). Collective."""
        self.reduce_pending(optimizer)
        return gradients.global_grad_norm(self.master_params(optimizer), self.transport, norm_type)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        self.reduce_pending(optimizer)
        return gradients.clip_by_global_norm(self.master_params(optimizer), self.transport, max_norm, norm_type)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        self.reduce_pending(optimizer)
        gradients.clip_by_value(self.master_params(optimizer), clip_value)

    def unscale_and_check_overflow(self, optimizer: Optimizer, inv_scale: float) -> bool:
        """Multiply the reduced gradients by ``inv_scale`` and tell whether any rank saw an inf/NaN (collective:
        every rank gets the same answer, so every rank skips together).

        Once per step: manual optimization unscales when the user clips, before ``opt.step()`` asks again; the
        second call returns the first answer without unscaling twice. The step, a skipped step and zero_grad()
        start a new one. Clip after the last backward of a step: gradients reduced after the unscaling would stay
        scaled (as with torch's GradScaler.unscale_)."""
        index = self.optimizer_index(optimizer)
        if index not in self._overflow_found:
            self.reduce_pending(optimizer)
            pieces = self.master_params(optimizer)
            self._overflow_found[index] = gradients.unscale_and_find_overflow(pieces, self.transport, inv_scale)
        return self._overflow_found[index]

    def first_nonfinite_param(self, optimizer: Optimizer) -> str | None:
        """The first parameter (in flat order, lowest rank first) whose reduced gradient is not finite. Collective."""
        flats = self._flat_params_of(self.optimizer_index(optimizer))
        return gradients.first_nonfinite_parameter(flats, self.transport)

    def discard_grads(self, optimizer: Optimizer) -> None:
        """Drop all gradients of ``optimizer``'s parameters (a skipped step changes nothing)."""
        self._overflow_found.pop(self.optimizer_index(optimizer), None)
        self._agreed.discard(self.optimizer_index(optimizer))
        self._unused_saved.pop(self.optimizer_index(optimizer), None)
        for flat in self._flat_params_of(self.optimizer_index(optimizer)):
            flat.discard_grads()

    @contextmanager
    def step_window(self, optimizer: Optimizer) -> Iterator[StepWindow]:
        """The one way through an optimizer step, in the order of the communication plan.

        On entry the reduced gradients are on ``optimizer``'s master pieces (:meth:`prepare_step`). Inside, the
        caller may unscale, clip and inspect them, then steps (:meth:`step`). On exit the updated slices reach the
        module's parameters (:meth:`after_step`) — unless :meth:`StepWindow.skip` was called (an fp16 overflow):
        then the gradients are dropped on every rank and nothing moves. An exception inside leaves the step
        unfinished and propagates."""
        self.prepare_step(optimizer)
        window = StepWindow()
        yield window
        if window.skipped:
            self.discard_grads(optimizer)
        else:
            self.after_step(optimizer)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """One whole optimizer step: ``with step_window(optimizer): step(optimizer)``."""
        with self.step_window(optimizer):
            return self.step(optimizer, **kwargs)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step the user's optimizer on the master slices (in chunks when they live in files; calling
        ``optimizer.step()`` directly works too, except for that chunking)."""
        if self.placement is not None and self.placement.store is not None:
            chunked_step(optimizer, self.config.nvme_chunk_numel, self.placement.store)
            return None
        return optimizer.step(**kwargs)

    def after_step(self, optimizer: Optimizer) -> None:
        """Propagate the updated slices: stages 1/2 gather them into the full parameters; stage 3 only drops any
        gathered copy so the next forward gathers the new values."""
        index = self.optimizer_index(optimizer)
        self._overflow_found.pop(index, None)
        self._agreed.discard(index)
        restore_unused(self._unused_saved.pop(index, []))
        refreshing = []
        for flat in self._flat_params_of(index):
            flat.grad_seen = [False] * len(flat.params)
            if flat.keeps_full and not flat.shard_aliases_full:  # the masters overwrite the parameters next
                flat.in_place.check(OVERWRITTEN)  # see [Note: in-place changes outside the optimizer]
            flat.refresh_device_source()
            refreshing.append(flat.start_publish_shard())  # all gathers are posted before the first wait
        for finish in refreshing:
            finish()
        self._shared_write_barrier("after the optimizer step")  # our new shards are complete before peers read

    # --------------------------------------------------------------------------------------------- access
    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Make every parameter of the module whole for the duration of the block (e.g. ``state_dict()``)."""
        for unit in self.units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.release_gathered()

    def release(self, full: bool | None = None) -> bool:
        """Undo the sharding: remove the hooks and give the module standalone, up-to-date full parameters, or
        (``full=False``) leave them on the meta device with this engine's slices as the weights. ``None``: the
        config's ``full_params_after_fit``, whose default keeps a model built sharded at stage 3 sharded (see
        [Note: releasing a model built sharded] in core/release.py). Returns whether the parameters are full."""
        if full is None:
            full = self.config.full_params_after_fit
        if full is None:
            full = not (self.built_sharded and self.stage.reshards_parameters)
        self.hooks.remove()
        for optimizer in self.optimizers:
            remove_zero_grad_hook(optimizer)
            remove_fused_steps(optimizer)
        self.exchange = None  # its arenas are freed with the last reference
        for flat in self.flat_params:
            flat.exchange = None
            for param in flat.params:
                param.grad = None
            if full:
                gather_into_module(flat)
            else:
                leave_sharded(flat)
        if self.placement is not None and self.placement.store is not None:
            # the files are unlinked; their mappings (a sharded release's slices, the optimizer state) stay valid
            self.placement.store.close()
        return full
