"""ZeroPrecision: the precision plugin ZeroStrategy always runs with.

It owns the order of an optimizer step, which ZeRO changes: the closure (forward + backward) runs, the strategy's
engine makes the reduced gradient slices available, then Lightning's ``on_before_optimizer_step`` and clipping run
on those slices (clipping by norm sees the global norm), then the user's optimizer steps the slices and the engine
propagates the new values. It contains no collectives: it calls the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.types import Steppable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from zero_strategy.core.engine import ZeroEngine

SUPPORTED_PRECISION = ("32-true", "32")


class ZeroPrecision(Precision):
    """fp32 training with ZeRO: the master slices are the parameters' only fp32 copy."""

    def __init__(self, precision: str = "32-true") -> None:
        if str(precision) not in SUPPORTED_PRECISION:
            raise ValueError(
                f"ZeroPrecision(precision={precision!r}) is not supported; use '32-true'. "
                "(fp16/bf16 mixed precision for ZeRO is not implemented yet.)"
            )
        self.precision = "32-true"  # type: ignore[assignment]
        self._engine: ZeroEngine | None = None

    def attach(self, engine: ZeroEngine | None) -> None:
        """Called by ZeroStrategy once the model is sharded (None after teardown)."""
        self._engine = engine

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPrecision is used before ZeroStrategy sharded the model (setup() not run).")
        return self._engine

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: LightningModule | nn.Module,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        assert isinstance(optimizer, Optimizer)
        closure_result = closure()
        self.engine.prepare_step(optimizer)
        if isinstance(model, LightningModule):
            self._after_closure(model, optimizer)
        result = optimizer.step(**kwargs)
        self.engine.after_step(optimizer)
        return closure_result if result is None else result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.engine.clip_grad_norm_(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.engine.clip_grad_value_(optimizer, float(clip_val))
