"""One place that picks the writer of ``ZeroConfig.checkpoint_format``: our sharded directory or a DCP directory,
and with tensor parallelism one sharded directory per TP coordinate (checkpoint/sharded/tensor_parallel_save.py)."""

from __future__ import annotations

import os
from typing import Any

from zero_strategy.checkpoint.base.format import CheckpointError
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
    if tensor is not None and tensor.size > 1:
        if checkpoint_format is CheckpointFormat.dcp:
            # our DCP writer names each box by its place in the rank's local block; with tensor parallelism that
            # is not the place in the whole tensor, and a DCP reader would assemble wrong tensors
            raise CheckpointError(
                'checkpoint_format="dcp" does not support tensor_parallel_size > 1 yet: save with the default '
                'checkpoint_format="zero" (resumable at any data-parallel size), or convert it afterwards with '
                "zero-to-fp32."
            )
        save_tensor_parallel(engine, tensor, path, trainer_state, info)
    elif checkpoint_format is CheckpointFormat.dcp:
        from zero_strategy.checkpoint.dcp.save import save_dcp  # torch's DCP modules load only when used

        save_dcp(engine, path, trainer_state, info)
    else:
        save_sharded(engine, path, trainer_state, info)
