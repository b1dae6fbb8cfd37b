"""ZeroUnit: one module's worth of parameters, stored as FlatParams, with the transitions the hooks call."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

from torch import nn

from zero_strategy.core.flat.flat_param import FlatParam, ParamState


class TrainingState(Enum):
    """What the unit is doing right now, so hooks know whether a forward is a recomputation inside backward."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class ZeroUnit:
    """The parameters one module stores, split into FlatParams by kind (dtype × which optimizers step them; see
    core/plan/flat_specs.py)."""

    def __init__(self, name: str, module: nn.Module, flat_params: list[FlatParam]) -> None:
        self.name = name
        self.module = module
        self.flat_params = flat_params
        self.state = TrainingState.IDLE
        self.has_frozen = any(not flat.trainable for flat in flat_params)
        self.trainable_params = [p for flat in flat_params if flat.trainable for p in flat.params]
        self.grads_ready = 0  # post-accumulate-grad hooks fired in the current backward

    @property
    def is_root(self) -> bool:
        return self.name == ""


    @property
    def whole(self) -> bool:
        """Every FlatParam of the unit holds its full values now."""
        return all(flat.state is ParamState.UNSHARDED for flat in self.flat_params)

    def start_unshard(self) -> None:
        for flat in self.flat_params:
            flat.start_unshard()

    def unshard(self) -> None:
        for flat in self.flat_params:
            flat.unshard()

    def reshard(self) -> None:
        for flat in self.flat_params:
            flat.reshard()

    def release_gathered(self) -> None:
        """Free the gathered parameters unless the stage keeps them (see FlatParam.release_gathered)."""
        for flat in self.flat_params:
            flat.release_gathered()

    def start_reduce(
        self,
        optimizer_index: int | None = None,
        force: Callable[[FlatParam], bool] | None = None,
    ) -> None:
        """Start reduce-scattering pending gradients (of the FlatParams one optimizer steps, or all);
        :meth:`finish_reduce` waits and accumulates them. ``force(flat)`` True: reduce that FlatParam even without a
        local gradient (a peer may have one)."""
        for flat in self.flat_params:
            if flat.trainable and (optimizer_index is None or optimizer_index in flat.optimizers):
                flat.grads.start_reduce(force=force is not None and force(flat))

    def finish_reduce(self) -> None:
        for flat in self.flat_params:
            flat.grads.finish_reduce()

    def reductions_in_flight(self) -> int | None:
        """How many of this unit's reductions may stay in flight while backward goes on (see [Note: overlapped
        reduction] in backward_reductions.py): the tightest bound of its FlatParams' comms (None: unbounded)."""
        bounds = [flat.comm.reductions_in_flight for flat in self.flat_params if flat.trainable]
        limited = [bound for bound in bounds if bound is not None]
        return min(limited) if limited else None

    def expected_grads(self) -> int:
        """How many post-accumulate-grad hooks a backward that reaches every parameter fires."""
        return sum(1 for p in self.trainable_params if p.requires_grad)
