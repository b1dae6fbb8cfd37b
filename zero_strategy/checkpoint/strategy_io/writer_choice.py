"""One place that picks the writer of ``ZeroConfig.checkpoint_format``: our sharded directory (with tensor parallelism
one per TP coordinate: checkpoint/sharded/tensor_parallel_save.py) or one DCP directory of the whole world."""

from __future__ import annotations

import os
from typing import Any

from zero_strategy.checkpoint.base.writable import WritableSource
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded
from zero_strategy.checkpoint.sharded.tensor_parallel_save import save_tensor_parallel
from zero_strategy.config import CheckpointFormat


def save_checkpoint_as(
    checkpoint_format: CheckpointFormat,
    engine: WritableSource,
    path: str | os.PathLike,
    trainer_state: dict[str, Any],
    info: SaveInfo,
) -> None:
    """Collective: write ``engine``'s state and ``trainer_state`` at ``path`` in ``checkpoint_format``."""
    tensor = engine.comms.tensor
    if checkpoint_format is CheckpointFormat.dcp:
        from zero_strategy.checkpoint.dcp.save import save_dcp  # torch's DCP modules load only when used

        # with tensor parallelism too: one DCP directory of whole tensors (see checkpoint/dcp/tensor_parallel.py)
        save_dcp(engine, path, trainer_state, info)
    elif tensor is not None and tensor.size > 1:
        save_tensor_parallel(engine, tensor, path, trainer_state, info)
    else:
        save_sharded(engine, path, trainer_state, info)
