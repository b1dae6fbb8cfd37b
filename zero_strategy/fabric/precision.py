"""ZeroFabricPrecision: the precision plugin ZeroFabricStrategy always runs with.

One optimizer step, as Fabric drives it (``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``):
backward runs on the loss times the loss scale (fp16); the step window makes the reduced gradient slices
available; with fp16 they are unscaled and checked for inf/NaN on every rank (one scalar all-reduce, so all ranks
agree; a ``clip_gradients`` call before the step has already done it); an overflow skips the step everywhere (no
optimizer step, gradients dropped, the scale moves); otherwise the optimizer steps the fp32 master slices and the
engine propagates the new values into the compute-dtype parameters. It contains no collectives: it calls the
engine. What the precision names mean and the fp16 skip decision are core/engine/precision_settings.py's (shared
with the Trainer's ZeroPrecision; re-exported here for the old import path).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.loss_scaler import DynamicLossScaler
from zero_strategy.core.engine.precision_settings import PrecisionSettings, engine_device_type, skip_step_on_overflow

__all__ = ["PrecisionSettings", "ZeroFabricPrecision", "engine_device_type", "skip_step_on_overflow",
           "to_zero_fabric_precision"]


class ZeroFabricPrecision(Precision):
    """``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (dynamic loss scaling when ``loss_scale`` is 0) under
    ZeroFabricStrategy; keywords as :class:`zero_strategy.ZeroPrecision`.

    Mixed precision stores the compute-dtype parameters ZeRO gathers and runs forward under autocast; the fp32
    master slices are the source of truth. Normalization layers compute in fp32.
    """

    def __init__(self, precision: str | int = "32-true", **knobs: Any) -> None:
        self.settings = PrecisionSettings(precision, **knobs)
        self.precision = self.settings.precision  # type: ignore[assignment]
        self._engine_of: Callable[[Optimizer], ZeroEngine] | None = None
        self._device_type: str | None = None

    @property
    def scaler(self) -> DynamicLossScaler | None:
        return self.settings.scaler

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when not scaling)."""
        return self.scaler.scale if self.scaler else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler else 0

    def attach(self, engine_of: Callable[[Optimizer], ZeroEngine] | None, device_type: str | None) -> None:
        """Called by ZeroFabricStrategy: how to find an optimizer's engine, and where modules compute."""
        self._engine_of, self._device_type = engine_of, device_type

    def engine_of(self, optimizer: Optimizer) -> ZeroEngine:
        if self._engine_of is None:
            raise RuntimeError("ZeroFabricPrecision is used before ZeroFabricStrategy set up a module.")
        return self._engine_of(optimizer)

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.settings.autocast(self._device_type)

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        # Fabric ignores what pre_backward returns: the loss is scaled here, as Fabric's own MixedPrecision does
        self.settings.scale(tensor).backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        assert isinstance(optimizer, Optimizer)
        if "closure" in kwargs:
            raise ValueError(
                "optimizer.step(closure) is not supported under ZeRO: the step reduces the gradients of the "
                "backwards before it, so a closure's forward and backward would come too late. Run them before "
                "optimizer.step()."
            )
        engine = self.engine_of(optimizer)
        with engine.step_window(optimizer) as window:
            if self.scaler is not None and skip_step_on_overflow(engine, self.scaler, optimizer, self.scaler.iteration):
                window.skip()  # the window drops the gradients on every rank: nothing moves
                return None
            return engine.step(optimizer, **kwargs)

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        """This rank's fp32 master slices (what the optimizer steps)."""
        return self.engine_of(optimizer).master_params(optimizer)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """fp16: the reduced gradients are unscaled once per step (the step finds it done); returns nothing."""
        self.unscale_and_check(optimizer)

    def unscale_and_check(self, optimizer: Optimizer) -> bool:
        """fp16: unscale ``optimizer``'s reduced gradients once per step and tell whether any rank overflowed (False
        without a loss scaler). Collective."""
        if self.scaler is None:
            return False
        return self.engine_of(optimizer).unscale_and_check_overflow(optimizer, 1.0 / self.scaler.scale)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


def to_zero_fabric_precision(plugin: Precision) -> ZeroFabricPrecision:
    """Translate a Fabric precision plugin (Precision, MixedPrecision, HalfPrecision) into ZeroFabricPrecision,
    refusing what ZeRO cannot honour with ZeroFabricPrecision's error."""
    if isinstance(plugin, ZeroFabricPrecision):
        return plugin
    return ZeroFabricPrecision(str(getattr(plugin, "precision", "32-true")))
