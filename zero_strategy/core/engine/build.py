"""Building an engine's parts, in the order their decisions need: the units and FlatParams planned from shapes,
the engine's comms (EngineComms) sized from those units, each FlatParam's storage and initial values, then the
values a meta-built or pretrained module gets. Collective: every rank builds in the same order."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from zero_strategy.config import OffloadDevice, ZeroConfig
from zero_strategy.core.comm.engine_comms import EngineComms
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.engine.hybrid import adopt_first_replica
from zero_strategy.core.engine.optimizer import check_optimizer, param_owners
from zero_strategy.core.flat.flat_param import FlatLinks, FlatParam
from zero_strategy.core.flat.full_buffer import FullBuffer
from zero_strategy.core.flat.placement import Placement, make_placement
from zero_strategy.core.flat.storage import FlatStorage, StorageOptions
from zero_strategy.core.init import ReplayStats
from zero_strategy.core.init.materialize import (
    InitialValues,
    check_materializable,
    load_pretrained,
    prepare_replay,
    replay_construction,
)
from zero_strategy.core.plan.flat_specs import FlatSpec, plan_flat_params
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.tensor_parallel import local_part
from zero_strategy.core.plan.topology import RankLayout
from zero_strategy.core.plan.units import choose_unit_modules, plan_units
from zero_strategy.core.runtime.compile_check import warn_compiled_around_units
from zero_strategy.core.runtime.unit import ZeroUnit


@dataclass(slots=True)
class EngineParts:
    """What :func:`build_parts` made."""

    units: list[ZeroUnit]
    comms: EngineComms
    placement: Placement | None
    device: torch.device  # where the module computes
    built_sharded: bool  # no rank ever held the whole module (it was built on the meta device)
    replay_stats: ReplayStats | None


def build_parts(
    module: nn.Module,
    optimizers: list[Optimizer],
    config: ZeroConfig,
    layout: RankLayout,
    policy: MixedPrecisionPolicy | None,
    initial_values: InitialValues | None,
) -> EngineParts:
    """Shard ``module``: plan, allocate, fill. Collective."""
    for optimizer in optimizers:
        check_optimizer(optimizer, config.allow_untested_optimizer)
    _refuse_fsdp(module)
    materialize_on = check_materializable(module, initial_values)
    recording = initial_values.recording if initial_values is not None else None
    # planned while the tensors are still meta: building the FlatParams gives them storage
    replay = prepare_replay(module, recording) if recording is not None and materialize_on is not None else None
    stage = config.zero_stage
    unit_paths = choose_unit_modules(module, config.unit_modules, config.min_unit_numel)
    plans = plan_units(module, unit_paths)
    if stage.reshards_parameters:  # stages 1/2 gather nothing during forward: nothing breaks a graph
        warn_compiled_around_units(module, unit_paths)
    device = materialize_on or next((p.device for p in module.parameters()), torch.device("cpu"))
    offloaded = OffloadDevice.none is not config.offload_optimizer or config.offload_param is not OffloadDevice.none
    comms = EngineComms(config, layout, device, offloaded, CommunicationLog(topology=layout.topology))
    try:
        placement = make_placement(config, device, plans, comms.group.rank)
        specs = plan_flat_params(plans, param_owners(optimizers), policy, comms.group.size)
        every_spec = [spec for unit_specs in specs for spec in unit_specs]
        host_fulls = comms.host_shared_buffers(every_spec) if stage.reshards_parameters else None
        comms.finish([spec for spec in every_spec if spec.trainable])
        options = StorageOptions(not stage.reshards_parameters, device, placement)
        fulls = iter(host_fulls or [])
        units = []
        for plan, unit_specs in zip(plans, specs, strict=True):
            flats = [_flat_param(spec, comms, options, next(fulls, None), deferred=materialize_on is not None)
                     for spec in unit_specs]
            units.append(ZeroUnit(plan.name, plan.module, flats))
        flat_params = [flat for unit in units for flat in unit.flat_params]
        if comms.host_shared:  # every rank wrote its slices of the host's buffers before any rank reads them
            comms.shard.barrier("construction").wait()
        if comms.replicas is not None:
            adopt_first_replica(flat_params, comms.replicas)  # replicas start from global rank 0
        stats = replay_construction(module, flat_params, replay, comms.everyone) if replay is not None else None
    except BaseException:
        comms.close()
        raise
    if initial_values is not None and initial_values.pretrained is not None:
        load_pretrained(module, flat_params, initial_values.pretrained, comms.group.rank)
    return EngineParts(units, comms, placement, device, materialize_on is not None, stats)


def _refuse_fsdp(module: nn.Module) -> None:
    """A module FSDP2 already shards (``fully_shard``, as a module written for ModelParallelStrategy calls in
    ``configure_model``) would be sharded twice over the same ranks: refused, naming the remedy."""
    wrapped = [name or "<root>" for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]
    if wrapped:
        shown = ", ".join(wrapped[:4]) + (" ..." if len(wrapped) > 4 else "")
        raise ValueError(
            f"ZeRO: {shown} {'is' if len(wrapped) == 1 else 'are'} already sharded by FSDP2's fully_shard. ZeRO shards "
            "over the data-parallel ranks itself: call fully_shard only under ModelParallelStrategy (e.g. `if "
            "isinstance(self.trainer.strategy, ModelParallelStrategy)`), keeping parallelize_module for both."
        )


def _flat_param(
    spec: FlatSpec, comms: EngineComms, options: StorageOptions, host_full: FullBuffer | None, deferred: bool
) -> FlatParam:
    """One FlatParam, its storage holding the group's first rank's values (DDP broadcasts rank 0's too), or
    nothing yet when the module was built on the meta device (its values are replayed or loaded later)."""
    initial = None if deferred else _initial_values(spec, comms, options.device)
    storage = FlatStorage(spec, comms.group.rank, initial, options, host_full)
    links = FlatLinks(
        rank=comms.group.rank,
        comm=comms.for_flat(spec),
        secondary=comms.secondary,
        has_replicas=comms.replicas is not None and comms.replicas.count > 1,
        streams=comms.streams,
    )
    flat = FlatParam(spec, storage, links, keeps_full=options.keeps_full)
    if deferred:
        flat.release_gathered()  # stage 3: the buffer's pages were never touched; nothing to keep
    return flat


def _initial_values(spec: FlatSpec, comms: EngineComms, device: torch.device) -> Tensor:
    """The parameters laid out flat (padded, their own dtype) as the group's first rank has them."""
    full = torch.zeros(spec.layout.padded_numel, dtype=spec.stored_dtype, device=device)
    with torch.no_grad():
        for span, (_, param) in zip(spec.layout.spans, spec.named_params, strict=True):
            full[span.offset : span.end].copy_(local_part(param.detach()).reshape(-1))  # a DTensor: its block
    comms.network.broadcast(full, 0, f"initial values of {spec.label}").wait()
    return full
