"""What a user can set on a ZeRO run: plain dataclasses, validated when built.

The library takes these dataclasses (or the same names as keywords); only ``examples/`` and ``conf/`` touch Hydra.
Enums rather than ``Literal`` because OmegaConf rejects ``Literal`` in structured configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


class ZeroConfigError(ValueError):
    """An invalid ZeRO setting: the message names the key and how to fix it."""


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """Options of :class:`zero_strategy.ZeroStrategy` (everything except the Lightning plumbing)."""

    stage: int = 3
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""

    unit_modules: list[str] = field(default_factory=list)
    """Class names (``"Block"``) or dotted paths of modules that each become one communication unit (the
    transformer block, typically). Empty: automatic (children of ``nn.ModuleList`` plus the size threshold)."""

    min_unit_numel: int = 1_000_000
    """Automatic units: a module whose not-yet-assigned parameters reach this many elements becomes a unit."""

    prefetch: bool = True
    """Stage 3: start the all-gather of the next unit while the current one computes."""

    broadcast_buffers: bool = True
    """Broadcast rank 0's floating-point buffers (BatchNorm statistics) before each training forward, as DDP does."""

    allow_untested_optimizer: bool = False
    """Accept an optimizer class that is not on the list of element-wise optimizers known to be exact on flat
    slices. Only set this if your optimizer's update of each element depends on that element's history alone."""

    process_group_timeout_s: float = 1800.0
    """Seconds a collective may wait before the process group gives up (torch's default is 30 minutes)."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ZeroConfigError(
                f"stage={self.stage!r} is not a ZeRO stage: use 1 (optimizer state sharded), "
                "2 (+ gradients) or 3 (+ parameters)."
            )
        if isinstance(self.unit_modules, str):
            raise ZeroConfigError(
                f"unit_modules={self.unit_modules!r} must be a list of class names, e.g. [{self.unit_modules!r}]."
            )
        if self.min_unit_numel < 1:
            raise ZeroConfigError(f"min_unit_numel={self.min_unit_numel!r} must be a positive element count.")
        if self.process_group_timeout_s <= 0:
            raise ZeroConfigError(
                f"process_group_timeout_s={self.process_group_timeout_s!r} must be a positive number of seconds."
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ZeroConfig:
        """Build from keywords, naming any key that is not an option (rather than a bare ``TypeError``)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ZeroConfigError(
                f"unknown ZeRO option(s) {unknown}; valid options are {sorted(known)}."
            )
        return cls(**kwargs)
