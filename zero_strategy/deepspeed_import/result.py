"""What a DeepSpeed config means here: :class:`DeepSpeedImport`, the result of ``parse_deepspeed_config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zero_strategy.deepspeed_import.batch import BatchRule, ResolvedBatch
from zero_strategy.deepspeed_import.errors import DeepSpeedConfigError

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")


@dataclass(kw_only=True, slots=True)
class DeepSpeedImport:
    """What a DeepSpeed config means here: ``ZeroStrategy(**result.zero_config_kwargs())``,
    ``ZeroPrecision(result.precision, **result.precision_kwargs)``, ``Trainer(gradient_clip_val=...)``."""

    source: str = "<dict>"
    """The config file (``"<dict>"`` for a mapping)."""
    zero_options: dict[str, Any] = field(default_factory=dict)
    """ZeroConfig keyword arguments, only those the config sets."""
    precision: str = "32-true"
    """"32-true", "16-mixed" or "bf16-mixed" ("32-true" too when the enabled flags are "auto": see ``auto``)."""
    precision_kwargs: dict[str, Any] = field(default_factory=dict)
    """ZeroPrecision keyword arguments: the fp16 loss-scale keys the config sets, and ``reduce_dtype``."""
    gradient_clip_val: float | None = None
    """Clip the global gradient norm to this; None when the config does not clip or leaves it to the Trainer."""
    activation_checkpointing: dict[str, Any] = field(default_factory=dict)
    """ZeroConfig keyword arguments for activation checkpointing (``cpu_checkpointing``). A DeepSpeed config does
    not name the modules to checkpoint: pass ``activation_checkpointing=[class names]`` yourself."""
    batch: BatchRule = field(default_factory=BatchRule)
    """The batch keys; :meth:`BatchRule.resolve` checks them against the Trainer."""
    inferred_batch: ResolvedBatch | None = None
    """The batch numbers checked at parse time (``world_size`` given and at most one key open)."""
    unmapped: list[str] = field(default_factory=list)
    """Dotted keys with no counterpart, reported in one warning."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why each key of ``unmapped`` has no counterpart."""
    auto: dict[str, str] = field(default_factory=dict)
    """Dotted keys written as "auto" → what decides them instead (the Trainer, or which default of ours)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise DeepSpeedConfigError(f"{self.source}: precision={self.precision!r}: use one of {PRECISIONS}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise DeepSpeedConfigError(f"{self.source}: gradient_clip_val={self.gradient_clip_val} must be > 0")

    def zero_config_kwargs(self) -> dict[str, Any]:
        """Everything for ``ZeroConfig(**...)`` / ``ZeroStrategy(**...)``: zero_options + activation_checkpointing."""
        return {**self.zero_options, **self.activation_checkpointing}
