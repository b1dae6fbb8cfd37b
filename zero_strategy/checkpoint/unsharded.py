"""Saving a sharded checkpoint when the module is not sharded: after ``fit`` returned.

[Note: saving after fit]
At the end of a fit the engine is released: the module holds standalone full parameters again, so it works
without us (evaluation, ``torch.save``, a further ``fit``). A checkpoint saved now must still be the sharded
directory a save during fit writes, or it cannot resume the run, be consolidated, or follow a ``ModelCheckpoint``
in the same folder. Two cases:

- The released engine of the fit is still at hand and its process group alive (the plain launcher: every rank ran
  the fit in this process). Its master slices and the optimizer state keyed by them are intact (release() leaves
  the optimizers pointing at the master pieces), so the save is the ordinary collective one. Each rank first copies
  its slice of the module's *current* full parameters into the engine's shard: the file holds what the module
  holds, even if the user changed it after fit.
- No fit engine (the spawn launcher's main process: the workers that held the optimizer state have exited; or a
  module that was only evaluated): a temporary stage-1 engine without optimizers is built over the module, writes
  the weights (one shard per rank of the current group, or one shard without a group) and is released. The
  optimizer state does not exist in this process; the manifest says so and why, so that resuming from it fails
  with that reason instead of silently restarting the optimizer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from zero_strategy.checkpoint.save import SaveInfo
from zero_strategy.checkpoint.writer_choice import save_checkpoint_as
from zero_strategy.config import OffloadDevice, ZeroConfig
from zero_strategy.core.engine import ZeroEngine

NO_OPTIMIZER_STATE_KEY = "optimizer_state_absent"
"""Manifest ``extra`` key: why a checkpoint holds no optimizer state (shown when a resume asks for it)."""


def copy_module_into_shards(engine: ZeroEngine) -> None:
    """Overwrite a *released* engine's shards with this rank's slices of the module's full parameters."""
    rank = engine.ctx.rank
    with torch.no_grad():
        for flat in engine.flat_params:
            by_name = dict(zip(flat.names, flat.params, strict=True))
            for piece in flat.layout.overlaps(rank):
                if by_name[piece.name].is_meta:  # released sharded: the shard is the only copy (core/release.py)
                    continue
                values = by_name[piece.name].detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel]
                flat.shard[piece.shard_start : piece.shard_start + piece.numel].copy_(values)


def save_module_weights(
    module: nn.Module,
    config: ZeroConfig,
    path: str | os.PathLike,
    trainer_state: dict[str, Any],
    info: SaveInfo,
) -> None:
    """Write a sharded checkpoint holding ``module``'s weights and buffers but no optimizer state (see
    [Note: saving after fit]). Collective over the default process group when there is one."""
    # Stage 1 keeps the full parameters (no freeing and re-gathering); nothing is offloaded to files or shared
    # memory for a save. The unit plan is the user's, so the checkpoint has the same units as one saved in fit.
    plain = dataclasses.replace(
        config,
        stage=1,
        offload_optimizer=OffloadDevice.none,
        offload_param=OffloadDevice.none,
        collectives="native" if config.collectives == "shared_memory" else config.collectives,
        activation_checkpointing=[],
        shard_group_size=None,  # every rank writes its slice of a flat layout: no replica groups to build
    )
    engine = ZeroEngine(module, [], plain)
    try:
        state = {k: v for k, v in trainer_state.items() if k != "optimizer_states"}
        save_checkpoint_as(config.checkpoint_format, engine, path, state, info)
    finally:
        engine.release()
