"""Old import path of :mod:`zero_strategy.core.engine.loss_scaler` (the room was renamed from step/ to engine/)."""

from zero_strategy.core.engine.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError, LossScalerConfig

__all__ = ["DynamicLossScaler", "LossScaleAtMinimumError", "LossScalerConfig"]
