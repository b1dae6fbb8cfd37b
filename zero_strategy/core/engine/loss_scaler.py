"""Loss scaling for fp16, with DeepSpeed's rules and knob names (see ARCHITECTURE.md §4)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients overflowed although the loss scale is already at its minimum."""


@dataclass(kw_only=True, slots=True)
class LossScalerConfig:
    """DeepSpeed's ``fp16`` block: ``loss_scale`` 0 means dynamic, > 0 a static scale."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_scale < 0:
            raise ValueError(f"loss_scale={self.loss_scale}: use 0 for dynamic scaling or a positive static scale")
        if self.loss_scale_window <= 0:
            raise ValueError(f"loss_scale_window={self.loss_scale_window} must be a positive number of iterations")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis={self.hysteresis} must be at least 1")
        if self.min_loss_scale <= 0:
            raise ValueError(f"min_loss_scale={self.min_loss_scale} must be positive")
        if self.loss_scale == 0 and self.min_loss_scale > 2.0**self.initial_scale_power:
            raise ValueError(
                f"min_loss_scale={self.min_loss_scale} is above the initial scale 2**{self.initial_scale_power}"
                f"={2.0**self.initial_scale_power}; lower min_loss_scale or raise initial_scale_power"
            )


class DynamicLossScaler:
    """The scale, and the rule that moves it after each optimizer step.

    On an overflow the step is skipped; if the hysteresis counter is at 1 the scale halves (never below the
    minimum), otherwise the counter drops by one. After ``loss_scale_window`` clean iterations since the last
    overflow the scale doubles and the counter refills; with ``consecutive_hysteresis`` every clean iteration
    refills it. An overflow that would need to go below the minimum raises :class:`LossScaleAtMinimumError`
    instead of skipping forever.
    """

    def __init__(self, config: LossScalerConfig) -> None:
        self.config = config
        self.dynamic = config.loss_scale == 0
        self.scale = 2.0**config.initial_scale_power if self.dynamic else float(config.loss_scale)
        self.hysteresis_left = config.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (call after deciding to skip or step)."""
        if overflow:
            self.skipped_steps += 1
            if self.dynamic:
                self._on_overflow()
            self.last_overflow_iteration = self.iteration
        elif self.dynamic:
            if self.config.consecutive_hysteresis:
                self.hysteresis_left = self.config.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.config.loss_scale_window == 0:
                if not self.config.consecutive_hysteresis:
                    self.hysteresis_left = self.config.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def would_fail(self, overflow: bool) -> bool:
        """True if this overflow cannot be absorbed: the scale must drop but is already at the minimum."""
        if not overflow:
            return False
        if not self.dynamic:
            return False
        return self.hysteresis_left <= 1 and self.scale <= self.config.min_loss_scale

    def _on_overflow(self) -> None:
        if self.hysteresis_left <= 1:
            self.scale = max(self.scale / 2.0, self.config.min_loss_scale)
        else:
            self.hysteresis_left -= 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "skipped_steps": self.skipped_steps,
            "config": asdict(self.config),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.skipped_steps = int(state["skipped_steps"])
