"""What a checkpoint's manifest records besides the engine, the same for both adapters' saves."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from zero_strategy.checkpoint.sharded.save import SaveInfo
from zero_strategy.version import library_version


def _lightning_version() -> dict[str, str]:
    # From the package metadata: checkpoint/ does not import Lightning (the adapters that call this run under it).
    try:
        return {"lightning": version("lightning")}
    except PackageNotFoundError:
        return {}


def save_info(
    precision: str, extra: dict[str, Any] | None = None, renames: dict[str, str | None] | None = None
) -> SaveInfo:
    """The manifest's facts for a save at ``precision`` (``extra``: its free-form notes; ``renames``: the keys the
    Trainer's save hooks renamed or dropped)."""
    versions = {"zero_strategy": library_version(), "torch": torch.__version__, **_lightning_version()}
    return SaveInfo(precision, {}, versions, dict(extra or {}), dict(renames or {}))
