"""One place that picks the writer of ``ZeroConfig.checkpoint_format``: our sharded directory or a DCP directory."""

from __future__ import annotations

import os
from typing import Any

from zero_strategy.checkpoint.base.writable import WritableSource
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded
from zero_strategy.config import CheckpointFormat


def save_checkpoint_as(
    checkpoint_format: CheckpointFormat,
    engine: WritableSource,
    path: str | os.PathLike,
    trainer_state: dict[str, Any],
    info: SaveInfo,
) -> None:
    """Collective: write ``engine``'s state and ``trainer_state`` at ``path`` in ``checkpoint_format``."""
    if checkpoint_format is CheckpointFormat.dcp:
        from zero_strategy.checkpoint.dcp.save import save_dcp  # torch's DCP modules load only when used

        save_dcp(engine, path, trainer_state, info)
    else:
        save_sharded(engine, path, trainer_state, info)
