"""What a ZeRO precision name and DeepSpeed's fp16 knobs mean for an engine (compute and reduction dtypes, the loss
scaler), and the fp16 decision to skip a step: shared by both adapters' precision plugins (the Trainer's
ZeroPrecision and ZeroFabricPrecision), which hold a :class:`PrecisionSettings` and call these. No Lightning."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor
from torch.optim import Optimizer

from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError, LossScalerConfig
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.precision_names import COMPUTE_DTYPES, normalize_precision, reduce_dtype_named

log = logging.getLogger(__name__)


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
