"""The strategy names ``import zero_strategy`` registers with Lightning, listed once: each with its stage, its
launcher and its options. The Lightning registration, the example's Hydra schema and the tests read this list."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from zero_strategy.core.stage import ZeroStage

START_METHODS = {"": "popen", "_spawn": "spawn"}
"""Name suffix → launcher: "popen" re-runs the script per rank (like ``ddp``), "spawn" starts ranks with
multiprocessing (notebooks, tests, Hydra sweeps)."""

# The registered nvme variant writes under the temp dir; pass nvme_path= for a fast local disk.
NVME_OFFLOAD_DIR = str(Path(tempfile.gettempdir()) / "zero_strategy_offload")


@dataclass(frozen=True, slots=True)
class NamedStrategy:
    """One registered name: ``Trainer(strategy=name)`` is ``ZeroStrategy(stage=..., start_method=..., **options)``."""

    name: str
    stage: ZeroStage
    start_method: str
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """ZeroConfig keywords besides the stage (the offload variants)."""

    @property
    def description(self) -> str:
        return f"ZeRO stage {int(self.stage)} {dict(self.options) or ''} ({self.start_method} launcher)"


_BASES: tuple[tuple[str, ZeroStage, dict[str, Any]], ...] = (
    ("zero1", ZeroStage.OPTIMIZER_STATES, {}),
    ("zero2", ZeroStage.GRADIENTS, {}),
    ("zero3", ZeroStage.PARAMETERS, {}),
    ("zero2_offload", ZeroStage.GRADIENTS, {"offload_optimizer": "cpu"}),
    ("zero3_offload", ZeroStage.PARAMETERS, {"offload_optimizer": "cpu", "offload_param": "cpu"}),
    ("zero3_offload_nvme", ZeroStage.PARAMETERS,
     {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": NVME_OFFLOAD_DIR}),
)  # fmt: skip

STRATEGY_NAMES: tuple[NamedStrategy, ...] = tuple(
    NamedStrategy(f"{base}{suffix}", stage, start_method, MappingProxyType(options))
    for base, stage, options in _BASES
    for suffix, start_method in START_METHODS.items()
)
"""Every name ``import zero_strategy`` registers (with Lightning installed)."""

BY_NAME: Mapping[str, NamedStrategy] = MappingProxyType({entry.name: entry for entry in STRATEGY_NAMES})
