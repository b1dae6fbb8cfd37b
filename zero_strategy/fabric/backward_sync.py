"""``fabric.no_backward_sync(model)`` under ZeRO: the strategy's backward-sync control (moved out of
fabric/strategy.py, which it kept past 350 lines)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from zero_strategy.core.engine.engine import ZeroEngine


class ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: stages 2/3 keep the gradients on the module instead of reducing them
    (see [Note: gradients held on the module] in core/runtime/backward_reductions.py)."""

    def __init__(self, engine_of: Callable[[nn.Module], ZeroEngine]) -> None:
        self._engine_of = engine_of  # the strategy's engine(module): a bound method, which pickles with it
        self._said = False

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        engine = self._engine_of(module)
        if engine.stage.reshards_parameters and not self._said:
            self._said = True
            rank_zero_info(
                "no_backward_sync under ZeRO stage 3: the gradient reductions of these backwards are skipped (the "
                "gradients stay on the module, full size, until the next backward outside it); the parameter "
                "gathers in forward and backward are not: each rank holds only its slice of the parameters."
            )
        return _held(engine)


@contextmanager
def _held(engine: ZeroEngine) -> Generator[None, None, None]:
    with engine.gradients_held():
        yield

