"""ZeroEngine: shards one module across the data-parallel ranks and steps the user's optimizers on slices.

Communication plan of one optimizer step (Ψ parameters, N ranks):
- stage 1: nothing during the micro-steps; at the step, per unit, one reduce-scatter of the accumulated full
  gradients (Ψ) and, after the slice update, one all-gather of the updated parameters (Ψ).
- stage 2: each unit is reduce-scattered as its backward completes (Ψ per micro-step); the all-gather after the
  step as in stage 1 (Ψ).
- stage 3: a unit is all-gathered before its forward (Ψ) and again before its backward (Ψ), and reduce-scattered
  after it (Ψ per micro-step); nothing is gathered after the step — the next forward gathers the new values.
Global-norm clipping adds one scalar all-reduce.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.collectives import (
    CommunicationLog,
    ProcessGroup,
    all_gather_object,
    all_reduce_sum,
    broadcast_flat,
    prefers_point_to_point,
)
from zero_strategy.core.flat_param import DistContext, FlatParam
from zero_strategy.core.hooks import RuntimeHooks
from zero_strategy.core.mixed_precision import MixedPrecisionPolicy
from zero_strategy.core.offload import chunked_step, make_placement
from zero_strategy.core.optimizer import (
    carve_state,
    check_optimizer,
    install_fused_steps,
    install_zero_grad_hook,
    param_group_index,
    remove_fused_steps,
    remove_zero_grad_hook,
    repoint_param_groups,
)
from zero_strategy.core.sharding import UnitPlan, choose_unit_modules, plan_units
from zero_strategy.core.shared_shards import SharedShards
from zero_strategy.core.stage import ZeroStage
from zero_strategy.core.unit import UnitOptions, ZeroUnit
from zero_strategy.core.unused import Saved, protect_unused, restore_unused


def _dist_context(group: ProcessGroup, collectives: str) -> DistContext:
    if dist.is_available() and dist.is_initialized():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        p2p = collectives == "point_to_point" or (collectives == "auto" and prefers_point_to_point(group))
        return DistContext(group, dist.get_rank(group), dist.get_world_size(group), src, p2p)
    return DistContext(None, 0, 1, 0)


class ZeroEngine:
    """Owns the units of one module, the hooks that drive them, and the binding of the user's optimizers."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        config: ZeroConfig,
        group: ProcessGroup = None,
        entry_module: nn.Module | None = None,
        policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        """``entry_module``: where a step's forward enters (Lightning's wrapper); defaults to ``module``.
        ``policy``: mixed precision (compute dtype, reduction dtype); None computes in the parameters' dtype."""
        self.module = module
        self.optimizers = list(optimizers)
        self.config = config
        self.stage = ZeroStage(config.stage)
        self.ctx = _dist_context(group, config.collectives)
        self.comm_log = CommunicationLog()
        self._unused_saved: dict[int, Saved] = {}
        self._overflow_found: dict[int, bool] = {}  # optimizer index -> unscaled this step; did any rank overflow
        for optimizer in self.optimizers:
            check_optimizer(optimizer, config.allow_untested_optimizer)
        owner = param_group_index(self.optimizers)
        unit_paths = choose_unit_modules(module, config.unit_modules, config.min_unit_numel)
        plans = plan_units(module, unit_paths)
        self.placement = make_placement(config, module, plans, self.ctx.rank)
        self.shared = self._shared_shards(module, plans)
        options = UnitOptions(not self.stage.reshards_parameters, policy, self.placement, self.shared)
        try:
            self.units = [ZeroUnit(plan, owner, self.ctx, self.comm_log, options) for plan in plans]
        except BaseException:
            if self.shared is not None:
                self.shared.discard_files()  # a failed set-up leaves nothing in /dev/shm
            raise
        if self.shared is not None and not self.shared.connect():
            self._shared_memory_unavailable(self.shared.failure or "")
        self._sync_buffers()
        self._repoint_optimizers()
        self.hooks = RuntimeHooks(
            self.units, self.stage, entry_module or module, config.prefetch, self._before_root_forward
        )
        self.hooks.reduce_dtype = policy.reduce_dtype if policy else None
        self.hooks.install()
        if self.stage.reshards_parameters:
            for unit in self.units:
                unit.reshard()

    # --------------------------------------------------------------------------------------------- set-up
    def _shared_shards(self, module: nn.Module, plans: list[UnitPlan]) -> SharedShards | None:
        """Shared-memory shards (see [Note: shared-memory gathers]) where asked for or, with "auto", where they
        apply: stage 3, gloo, no offload, every rank on this host's CPU. Collective."""
        choice = self.config.collectives
        applies = (
            self.stage.reshards_parameters
            and self.placement is None
            and self.ctx.world_size > 1
            and choice in ("auto", "shared_memory")
            and (choice == "shared_memory" or prefers_point_to_point(self.ctx.group))
        )
        if not applies:  # an explicit "shared_memory" off stage 3 or with offload is refused by ZeroConfig already
            return None
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        model_bytes = sum(p.numel() * p.element_size() for plan in plans for _, p in plan.named_params)  # all ranks
        if SharedShards.usable(self.ctx.group, device, model_bytes):
            return SharedShards(self.ctx.group, self.ctx.rank, self.ctx.world_size, self.ctx.src_rank)
        if choice == "shared_memory":
            raise ZeroConfigError(
                'collectives="shared_memory" needs every rank on one host, computing on its CPU, and room in '
                f'/dev/shm for {model_bytes / 2**20:.0f} MiB of shards; use "auto" or "point_to_point".'
            )
        return None

    def _shared_memory_unavailable(self, reason: str) -> None:
        """Every rank gets here together (the failure was agreed in ``connect``); gathers use the network."""
        if self.config.collectives == "shared_memory":
            raise ZeroConfigError(
                f'collectives="shared_memory": {reason}; free or enlarge /dev/shm (docker run --shm-size=...), or '
                'use "auto" or "point_to_point".'
            )
        warnings.warn(f"ZeRO stage 3: shared-memory gathers unavailable ({reason}); using point-to-point gathers.",
                      stacklevel=3)

    def _repoint_optimizers(self) -> None:
        for opt_index, optimizer in enumerate(self.optimizers):
            existing = dict(optimizer.state)  # e.g. Adagrad's accumulators, created at construction
            pieces_by_group: dict[int, list[nn.Parameter]] = {}
            for flat in self._flat_params_of(opt_index):
                for piece, group_index in zip(flat.master_pieces, flat.piece_group_index, strict=True):
                    pieces_by_group.setdefault(group_index, []).append(piece)
            repoint_param_groups(optimizer, pieces_by_group)
            optimizer.state.clear()
            if existing:
                for flat in self._flat_params_of(opt_index):
                    self._carry_state_over(optimizer, flat, existing)
            install_zero_grad_hook(optimizer, partial(self._on_zero_grad, opt_index))
            install_fused_steps(optimizer, self.config.fused_optimizer)

    def _carry_state_over(self, optimizer: Optimizer, flat: FlatParam, existing: dict) -> None:
        """Give each master piece the slices of the state its parameters already had."""
        by_name = dict(zip(flat.names, flat.params, strict=True))
        overlaps = flat.layout.overlaps(self.ctx.rank)
        for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
            parts = [o for o in overlaps if offset <= o.shard_start < offset + piece.numel()]
            carved = [carve_state(existing.get(by_name[o.name], {}), by_name[o.name], o.param_start, o.numel)
                      for o in parts]
            if not carved or not carved[0] or any(c.keys() != carved[0].keys() for c in carved):
                continue  # no state yet, or parameters in different states: the optimizer starts this piece fresh
            state = dict(carved[0])
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = torch.cat([c[key] for c in carved]).to(piece.device)
            optimizer.state[piece] = state

    def _on_zero_grad(self, optimizer_index: int) -> None:
        """See [Note: zero_grad reaches the module's gradients] in optimizer.py."""
        self._overflow_found.pop(optimizer_index, None)
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
            if self.stage.reshards_parameters:
                flat.reshard()
            else:
                flat.refresh_full_from_shards()
        if self.shared is not None:
            self.shared.after_writes()

    def _sync_buffers(self) -> None:
        """Adopt rank 0's buffers (DDP does this at wrap time and, by default, before every forward)."""
        buffers = [b for b in self.module.buffers() if b.numel() > 0]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for buffer in buffers:
            by_dtype.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        for group in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in group])
            broadcast_flat(flat, self.ctx.src_rank, self.ctx.group, self.comm_log)
            offset = 0
            with torch.no_grad():
                for buffer in group:
                    buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()

    def _before_root_forward(self) -> None:
        if self.config.broadcast_buffers and self.ctx.world_size > 1 and self.module.training:
            if torch.is_grad_enabled():
                self._sync_buffers()

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
        # All units' reductions are posted before the first wait: stage 1 holds every full gradient anyway, and
        # flattening releases the `.grad` it copies, so this costs no memory and lets the exchanges overlap.
        for unit in self.units:
            unit.start_reduce(index, reduce_dtype=self.hooks.reduce_dtype)
        for unit in self.units:
            unit.finish_reduce()
        # parameters that produced no gradient must not move (see [Note: unused parameters] in unused.py)
        self._unused_saved[index] = protect_unused(self._flat_params_of(index), optimizer)
        if self.shared is not None:
            self.shared.before_writes()  # peers are done reading our shards for this step

    def reduce_pending(self, optimizer: Optimizer) -> None:
        """Reduce-scatter ``optimizer``'s gradients that are still on the module (stage 1 keeps them there until
        the step) into its master pieces. Clipping and the overflow check call it, because under manual
        optimization they run before ``prepare_step`` (between backward and ``opt.step()``). Reducing releases the
        module's gradients, so a second call, or ``prepare_step`` after it, finds nothing left to send: the
        gradients are reduced exactly once per step. Collective (every rank calls it at the same point)."""
        index = self.optimizer_index(optimizer)
        for unit in self.units:
            unit.start_reduce(index, reduce_dtype=self.hooks.reduce_dtype)
        for unit in self.units:
            unit.finish_reduce()

    def grad_norm(self, optimizer: Optimizer, norm_type: float = 2.0) -> Tensor:
        """The norm of the full gradient across all ranks' slices (padding is in no piece, so excluded)."""
        self.reduce_pending(optimizer)
        grads = [p.grad for p in self.master_params(optimizer) if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=device)
            gathered = local.float().reshape(1)
            if self.ctx.world_size > 1:
                self.comm_log.record("all_reduce", gathered.element_size())
                dist.all_reduce(gathered, op=dist.ReduceOp.MAX, group=self.ctx.group)
            return gathered[0]
        local = torch.zeros(1, dtype=torch.float64, device=device)
        for grad in grads:
            local += grad.double().abs().pow(norm_type).sum()
        total = all_reduce_sum(local, self.ctx.group, self.comm_log)
        return total[0].pow(1.0 / norm_type).float()

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        total = self.grad_norm(optimizer, norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for param in self.master_params(optimizer):
            if param.grad is not None:
                param.grad.mul_(coefficient.to(param.grad.dtype))
        return total

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        self.reduce_pending(optimizer)
        for param in self.master_params(optimizer):
            if param.grad is not None:
                param.grad.clamp_(-clip_value, clip_value)

    def unscale_and_check_overflow(self, optimizer: Optimizer, inv_scale: float) -> bool:
        """Multiply the reduced gradients by ``inv_scale`` and tell whether any rank saw an inf/NaN (collective:
        every rank gets the same answer, so every rank skips together).

        Once per step: manual optimization unscales when the user clips, before ``opt.step()`` asks again; the
        second call returns the first answer without unscaling twice. The step, a skipped step and zero_grad()
        start a new one. Clip after the last backward of a step: gradients reduced after the unscaling would stay
        scaled (as with torch's GradScaler.unscale_)."""
        index = self.optimizer_index(optimizer)
        if index in self._overflow_found:
            return self._overflow_found[index]
        self.reduce_pending(optimizer)
        grads = [p.grad for p in self.master_params(optimizer) if p.grad is not None]
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else torch.device("cpu"))
        for grad in grads:
            if inv_scale != 1.0:
                grad.mul_(inv_scale)
            found += (~torch.isfinite(grad)).any().float()
        self._overflow_found[index] = bool(all_reduce_sum(found, self.ctx.group, self.comm_log).item() > 0)
        return self._overflow_found[index]

    def first_nonfinite_param(self, optimizer: Optimizer) -> str | None:
        """The first parameter (in flat order, lowest rank first) whose reduced gradient is not finite. Collective."""
        local: str | None = None
        for flat in self._flat_params_of(self.optimizer_index(optimizer)):
            for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
                if local is None and piece.grad is not None and not bool(torch.isfinite(piece.grad).all()):
                    bad = int((~torch.isfinite(piece.grad)).nonzero()[0].item()) + offset
                    local = next(o.name for o in flat.layout.overlaps(self.ctx.rank)
                                 if o.shard_start <= bad < o.shard_start + o.numel)
        names = all_gather_object(local, self.ctx.group)
        return next((name for name in names if name is not None), None)

    def discard_grads(self, optimizer: Optimizer) -> None:
        """Drop all gradients of ``optimizer``'s parameters (a skipped step changes nothing)."""
        self._overflow_found.pop(self.optimizer_index(optimizer), None)
        for flat in self._flat_params_of(self.optimizer_index(optimizer)):
            flat.discard_grads()

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
        restore_unused(self._unused_saved.pop(index, []))
        refreshing = []
        for flat in self._flat_params_of(index):
            flat.grad_seen = [False] * len(flat.params)
            flat.refresh_device_source()
            if self.stage.reshards_parameters:
                flat.reshard()
            else:  # every unit's gather is posted before the first wait, so they overlap
                refreshing.append(flat.start_refresh_full_from_shards())
        for finish in refreshing:
            finish()
        if self.shared is not None:
            self.shared.after_writes()  # our new shards are complete before any peer gathers them

    # --------------------------------------------------------------------------------------------- access
    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Make every parameter of the module whole for the duration of the block (e.g. ``state_dict()``)."""
        for unit in self.units:
            unit.unshard()
        try:
            yield
        finally:
            if self.stage.reshards_parameters:
                for unit in self.units:
                    unit.reshard()

    def release(self) -> None:
        """Undo the sharding: remove hooks and give the module standalone, up-to-date full parameters."""
        self.hooks.remove()
        for optimizer in self.optimizers:
            remove_zero_grad_hook(optimizer)
            remove_fused_steps(optimizer)
        for flat in self.flat_params:
            for param in flat.params:
                param.grad = None
            flat.release_to_module()
        if self.placement is not None and self.placement.store is not None:
            self.placement.store.close()
