"""ZeroUnit: one module's worth of parameters, stored as FlatParams, with the transitions the hooks call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn

from zero_strategy.core.flat_param import FlatOptions, FlatParam
from zero_strategy.core.mixed_precision import MixedPrecisionPolicy
from zero_strategy.core.offload import Placement
from zero_strategy.core.sharding import UnitPlan
from zero_strategy.core.transport.choice import DistContext
from zero_strategy.core.transport.collectives import CommunicationLog
from zero_strategy.core.transport.shared_shards import SharedShards
from zero_strategy.core.transport.streams import CollectiveStreams


@dataclass(frozen=True, slots=True)
class UnitOptions:
    """How every FlatParam of a unit is stored."""

    keeps_full: bool  # stages 1/2
    policy: MixedPrecisionPolicy | None  # mixed precision, or None
    placement: Placement | None  # offload, or None
    shared: SharedShards | None = None  # stage 3 on one host's CPU ranks: shards in shared memory
    materialize_device: torch.device | None = None  # meta parameters get storage there
    streams: CollectiveStreams | None = None  # CUDA side streams; None or disabled elsewhere


class TrainingState(Enum):
    """What the unit is doing right now, so hooks know whether a forward is a recomputation inside backward."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class ZeroUnit:
    """The parameters one module stores, split into FlatParams by kind: (dtype, which optimizer steps them).

    A FlatParam must be uniform in dtype (one flat buffer) and in optimizer (so that stepping one optimizer of a
    GAN communicates only its own parameters). Frozen or un-optimized parameters form their own FlatParam, which
    is gathered at stage 3 but never reduced and has no master pieces.
    """

    def __init__(
        self,
        plan: UnitPlan,
        owner: dict[int, tuple[int, int]],
        ctx: DistContext,
        log: CommunicationLog,
        options: UnitOptions,
    ) -> None:
        self.name = plan.name
        self.module = plan.module
        self.state = TrainingState.IDLE
        self.flat_params: list[FlatParam] = []
        self.optimizer_index: list[int | None] = []  # parallel to flat_params
        # kind = (stored dtype, compute dtype, optimizer): one flat buffer each
        kinds: dict[tuple[torch.dtype, torch.dtype, int | None], list[tuple[str, nn.Parameter]]] = {}
        policy = options.policy
        keep_fp32 = policy.full_precision_params(plan.module) if policy else set()
        for name, param in plan.named_params:
            optimized = param.requires_grad and id(param) in owner
            compute = param.dtype if policy is None or id(param) in keep_fp32 else policy.compute_dtype_for(param)
            kind = (param.dtype, compute, owner[id(param)][0] if optimized else None)
            kinds.setdefault(kind, []).append((name, param))
        for (_, compute, opt_index), named in kinds.items():
            if opt_index is None:
                group_of = None
            else:
                named.sort(key=lambda item: owner[id(item[1])][1])  # one contiguous range per param group
                group_of = {id(p): owner[id(p)][1] for _, p in named}
            reduce_dtype = policy.reduce_dtype if policy else None
            flat_options = FlatOptions(
                options.keeps_full, compute, options.placement, options.shared, reduce_dtype,
                options.materialize_device, options.streams,
            )
            self.flat_params.append(FlatParam(named, group_of, ctx, log, flat_options))
            self.optimizer_index.append(opt_index)
        self.has_frozen = any(not fp.trainable for fp in self.flat_params)
        self.trainable_params = [p for fp in self.flat_params if fp.trainable for p in fp.params]
        self.grads_ready = 0  # post-accumulate-grad hooks fired in the current backward

    @property
    def is_root(self) -> bool:
        return self.name == ""

    def start_unshard(self) -> None:
        for flat in self.flat_params:
            flat.start_unshard()

    def unshard(self) -> None:
        for flat in self.flat_params:
            flat.finish_unshard()

    def reshard(self) -> None:
        for flat in self.flat_params:
            flat.reshard()

    def release_gathered(self) -> None:
        """Free the gathered parameters unless the stage keeps them (see FlatParam.release_gathered)."""
        for flat in self.flat_params:
            flat.release_gathered()

    def reduce_grads(self, optimizer_index: int | None = None) -> None:
        """Reduce-scatter pending gradients (of one optimizer's FlatParams, or all) and wait for the result."""
        self.start_reduce(optimizer_index)
        self.finish_reduce()

    def start_reduce(
        self,
        optimizer_index: int | None = None,
        force: Callable[[FlatParam], bool] | None = None,
    ) -> None:
        """Start reduce-scattering pending gradients; :meth:`finish_reduce` waits and accumulates them.
        ``force(flat)`` True: reduce that FlatParam even without a local gradient (a peer may have one)."""
        for flat, index in zip(self.flat_params, self.optimizer_index, strict=True):
            if flat.trainable and (optimizer_index is None or index == optimizer_index):
                flat.start_reduce(force=force is not None and force(flat))

    def finish_reduce(self) -> None:
        for flat in self.flat_params:
            flat.finish_reduce()

    def reduces_in_shared_memory(self) -> bool:
        """Every reduction of this unit goes through the host's shared-memory arenas, so none holds private memory
        while in flight (see [Note: overlapped reduction] in hooks.py)."""
        return all(flat.reduces_in_shared_memory for flat in self.flat_params)

    def expected_grads(self) -> int:
        """How many post-accumulate-grad hooks a backward that reaches every parameter fires."""
        return sum(1 for p in self.trainable_params if p.requires_grad)
