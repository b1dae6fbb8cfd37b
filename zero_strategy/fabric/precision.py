"""ZeroFabricPrecision: the precision plugin ZeroFabricStrategy always runs with, and the ZeRO precision logic both
adapters share (the Trainer's ZeroPrecision imports it from here).

One optimizer step, as Fabric drives it (``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``):
backward runs on the loss times the loss scale (fp16); the step window makes the reduced gradient slices
available; with fp16 they are unscaled and checked for inf/NaN on every rank (one scalar all-reduce, so all ranks
agree; a ``clip_gradients`` call before the step has already done it); an overflow skips the step everywhere (no
optimizer step, gradients dropped, the scale moves); otherwise the optimizer steps the fp32 master slices and the
engine propagates the new values into the compute-dtype parameters. It contains no collectives: it calls the
engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.precision_names import COMPUTE_DTYPES, normalize_precision, reduce_dtype_named
from zero_strategy.core.step.engine import ZeroEngine
from zero_strategy.core.step.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError, LossScalerConfig

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- shared by both adapters
class PrecisionSettings:
    """What a ZeRO precision name and DeepSpeed's fp16 knobs mean: the compute and reduction dtypes, and the loss
    scaler (fp16 only). Both adapters' plugins hold one."""

    def __init__(
        self,
        precision: str | int = "32-true",
        *,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        reduce_dtype: str | None = None,
    ) -> None:
        # The knob names and defaults are DeepSpeed's fp16 block, which users know by heart.
        self.precision = normalize_precision(precision)
        self.compute_dtype = COMPUTE_DTYPES[self.precision]
        self.reduce_dtype = reduce_dtype_named(reduce_dtype)
        config = LossScalerConfig(
            loss_scale=loss_scale,
            initial_scale_power=initial_scale_power,
            loss_scale_window=loss_scale_window,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_loss_scale=min_loss_scale,
        )
        self.scaler = DynamicLossScaler(config) if self.compute_dtype == torch.float16 else None

    def policy(self) -> MixedPrecisionPolicy | None:
        if self.compute_dtype == torch.float32:
            return None
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)

    def autocast(self, device_type: str | None) -> AbstractContextManager:
        """The forward's context: autocast to the compute dtype (see [Note: fp32 normalization layers])."""
        if self.compute_dtype == torch.float32 or device_type is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype)

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss


def engine_device_type(engine: ZeroEngine | None) -> str | None:
    """Where ``engine``'s module computes (None before there is an engine)."""
    if engine is None:
        return None
    return engine.flat_params[0].full.device.type if engine.flat_params else "cpu"


def skip_step_on_overflow(engine: ZeroEngine, scaler: DynamicLossScaler, optimizer: Optimizer, step: int) -> bool:
    """fp16: unscale ``optimizer``'s reduced gradients and, on an inf/NaN on any rank, decide to skip this step on
    every rank and move the scale (True: skip). An overflow at the minimum scale raises instead. Collective."""
    overflow = engine.unscale_and_check_overflow(optimizer, 1.0 / scaler.scale)
    if overflow:
        culprit = engine.first_nonfinite_param(optimizer)
        log.debug("fp16 overflow at step %d (loss scale %g): first non-finite gradient in %s",
                  step, scaler.scale, culprit)
        if scaler.would_fail(overflow):
            raise LossScaleAtMinimumError(
                f"fp16 gradients overflowed at step {step} although the loss scale is already at its minimum "
                f"({scaler.config.min_loss_scale}); first non-finite gradient: {culprit}. Training cannot continue "
                "in fp16: use precision='bf16-mixed' (same exponent range as fp32), lower the learning rate, or "
                "lower min_loss_scale."
            )
    scaler.update(overflow)
    return overflow


# ------------------------------------------------------------------------------------------- the Fabric plugin
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
