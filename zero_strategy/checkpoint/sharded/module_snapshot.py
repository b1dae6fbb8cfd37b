"""A module no engine holds in this process, laid out as a one-rank engine would hold it: what ``save_sharded``
writes when the weights are in the module itself.

[Note: saving without an engine]
After a spawn-launched fit the main process has no engine (the workers that held the slices and the optimizer state
have exited) but, for a model built eagerly, Lightning handed it the trained weights; a module that was never
sharded in this process holds its own. Such a module is written as a checkpoint of one rank: the same units and
FlatParam keys an engine would plan, each FlatParam's values flattened in its own dtype, no optimizer state (the
manifest says why). Loading reads by parameter name and element range, so any world size and stage resumes from
it. Nothing is gathered, no process group is used (only this process writes), and no engine is built: the values
are read straight from the module, one FlatParam at a time. The snapshot is a ``WritableSource`` (see [Note: the
write protocol] in checkpoint/base/writable.py), as an engine is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.engine_comms import ReplicaComm, local_comm
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.plan.flat_specs import FlatSpec, plan_flat_params
from zero_strategy.core.plan.layout import FlatLayout
from zero_strategy.core.plan.units import choose_unit_modules, plan_units
from zero_strategy.core.stage import ZeroStage


class SnapshotFlat:
    """One FlatParam's worth of a module's parameters, flattened (what a one-rank engine's slice would hold)."""

    def __init__(self, spec: FlatSpec) -> None:
        self.names = [name for name, _ in spec.named_params]
        self.params = [param for _, param in spec.named_params]
        self.layout: FlatLayout = spec.layout
        self.optimizers: tuple[int, ...] = ()  # no optimizer state is saved from a module (see the Note)
        self.param_groups: list[tuple[int, ...]] = [()] * len(self.params)
        self.master_pieces: list[nn.Parameter] = []  # no optimizer pieces either
        self.piece_offset: list[int] = []
        self._dtype = spec.stored_dtype

    def piece_group_in(self, optimizer: int) -> list[int]:
        return []  # no pieces

    def param_group_in(self, optimizer: int) -> list[int]:
        raise ValueError(f"no optimizer steps a module snapshot (asked for optimizer {optimizer}): it has no groups")

    @property
    def shard(self) -> Tensor:
        """The values, flattened and padded (made when asked: one FlatParam at a time is held)."""
        flat = torch.zeros(self.layout.padded_numel, dtype=self._dtype)
        with torch.no_grad():
            for span, param in zip(self.layout.spans, self.params, strict=True):
                flat[span.offset : span.end].copy_(param.detach().reshape(-1))
        return flat


@dataclass(frozen=True, slots=True)
class _OneRank:
    """The only rank of the snapshot's one-rank world."""

    rank: int = 0
    world_size: int = 1
    replica_index: int = 0


class _LocalComms:
    def __init__(self, log: CommunicationLog) -> None:
        self.everyone: Comm = local_comm(log)
        self.replicas: ReplicaComm | None = None
        self.tensor: Comm | None = None  # a snapshot is written by one process: no tensor-parallel group


class ModuleSnapshot:
    """The checkpoint source of a module no engine holds (see [Note: saving without an engine]): a
    ``WritableSource``."""

    def __init__(self, module: nn.Module, config: ZeroConfig) -> None:
        unmaterialized = [name for name, param in module.named_parameters() if param.is_meta]
        if unmaterialized:
            raise ValueError(f"the module's parameters {unmaterialized[:3]} are on the meta device: it holds no values")
        self.module = module
        self.optimizers: list[torch.optim.Optimizer] = []
        self.stage = ZeroStage(config.stage)
        self.place = _OneRank()
        self.comms = _LocalComms(CommunicationLog())
        plans = plan_units(module, choose_unit_modules(module, config.unit_modules, config.min_unit_numel))
        specs = [spec for unit in plan_flat_params(plans, {}, None, 1) for spec in unit]
        self._flats = [(spec.key, SnapshotFlat(spec)) for spec in specs]

    def named_flat_params(self) -> Iterator[tuple[str, SnapshotFlat, tuple[int, ...]]]:
        yield from ((key, flat, flat.optimizers) for key, flat in self._flats)

    def parameter_names(self) -> dict[int, str]:
        return {id(p): name for _, flat in self._flats for name, p in zip(flat.names, flat.params, strict=True)}
