"""``zero-to-dcp``: a zero_strategy sharded checkpoint directory, rewritten as a ``torch.distributed.checkpoint``
directory by one process, without gathering anything.

Each rank's shard of each parameter (and of its optimizer state) becomes the boxes of that slice (see boxes.py);
one box is read from the shard files at a time, when DCP writes it, and dropped before the next (see [Note: DCP
writes that hold one box and survive a crash] in checkpoint/dcp/storage.py), so memory stays near one tensor whatever
the model's size. The key layout is [Note: DCP key layout] in checkpoint/dcp/content.py. Importable without Lightning.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from zero_strategy.checkpoint.base.format import BUFFERS_KEY, MANIFEST_NAME, PARAM_GROUPS_KEY, FlatEntry, ParamEntry
from zero_strategy.checkpoint.dcp.content import (
    INFO,
    MODEL,
    OURS,
    RNG,
    TRAINER_STATE,
    add_range,
    info_json,
    optimizer_content,
    param_group_entries,
    rng_record,
    to_bytes,
)
from zero_strategy.checkpoint.dcp.from_deepspeed import deepspeed_dcp_content
from zero_strategy.checkpoint.dcp.planner import ChunkedSavePlanner, ChunkedTensor
from zero_strategy.checkpoint.dcp.storage import StreamingFileWriter, discard_dcp, plan_dcp_staging, publish_dcp
from zero_strategy.checkpoint.deepspeed.layout import is_deepspeed_directory
from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zero_strategy.checkpoint.deepspeed.universal import open_deepspeed
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.shard_content import scalar_value

_CPU = torch.device("cpu")


def export_to_dcp(checkpoint: str | os.PathLike, output: str | os.PathLike, weights_only: bool = True) -> Path:
    """Write the sharded ``checkpoint`` directory (or a DeepSpeed ZeRO checkpoint directory) as a DCP checkpoint
    directory at ``output`` and return its path.

    ``output`` must not exist, be an empty directory, or be a DCP checkpoint (replaced atomically). The trainer
    state is unpickled with ``weights_only`` (``False`` only for checkpoints you trust whose hyper-parameters hold
    objects). Raises :class:`CheckpointError` for a damaged checkpoint or an output it must not overwrite."""
    target = Path(output)
    source = Path(checkpoint)
    from_deepspeed = is_deepspeed_directory(source) and not (source / MANIFEST_NAME).is_file()
    with open_deepspeed(source) if from_deepspeed else ShardedCheckpoint(source) as ckpt:
        if isinstance(ckpt, DeepSpeedCheckpoint):
            state_dict = deepspeed_dcp_content(ckpt)
        else:
            state_dict = checkpoint_state_dict(ckpt, ckpt.trainer_state(weights_only))
        staging = plan_dcp_staging(target)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp.save(
                    state_dict,
                    storage_writer=StreamingFileWriter(staging.directory, staging.save_id),
                    planner=ChunkedSavePlanner(),
                    no_dist=True,
                )
        except BaseException:
            discard_dcp(staging)
            raise
        publish_dcp(staging)
    return target


def checkpoint_state_dict(ckpt: ShardedCheckpoint, trainer_state: dict[str, Any]) -> dict[str, Any]:
    """The nested state dict of [Note: DCP key layout], every tensor a :class:`ChunkedTensor` read on demand."""
    manifest = ckpt.manifest
    weights: dict[str, ChunkedTensor] = {}  # canonical name -> its boxes (tied keys share one)
    model: dict[str, Any] = {}
    for key, kind, name in manifest.state_dict_keys:
        if kind == "param":
            if name not in weights:
                weights[name] = _param_tensor(ckpt, name, "flat")
            model[key] = weights[name]
        else:
            model[key] = trainer_state[BUFFERS_KEY][key]
    content: dict[str, Any] = {MODEL: model}
    if manifest.has_optimizer_state:
        shared = any(len(flat.optimizers) > 1 for flat in manifest.flat_params)
        states = [_optimizer_states(ckpt, index) for index in range(len(manifest.optimizers))]
        content.update(optimizer_content(states, _param_groups(ckpt, trainer_state), shared))
    rng = {str(rank): rng_record(*ckpt.rng_state(rank)) for rank in range(manifest.world_size)}  # type: ignore[misc]
    own_state = {k: v for k, v in trainer_state.items() if k not in (BUFFERS_KEY, PARAM_GROUPS_KEY)}
    info = info_json(
        manifest.world_size, manifest.stage, manifest.precision, manifest.versions, manifest.optimizers, manifest.extra
    )
    content[OURS] = {TRAINER_STATE: to_bytes(own_state), RNG: rng, INFO: info}
    return content


def _param_tensor(ckpt: ShardedCheckpoint, name: str, tensor_of: str, optimizer: int | None = None) -> ChunkedTensor:
    """Parameter ``name``'s weights (``"flat"``) or one optimizer state (``"optim:<name>"``, of optimizer
    ``optimizer``) as the boxes of each rank's slice of it: the chunks follow the shards that wrote the checkpoint."""
    flat, param = ckpt.params[name]
    dtype = ckpt.read_param(name, tensor_of, 0, 0, optimizer).dtype  # an empty read: the stored dtype, nothing loaded
    tensor = ChunkedTensor(tuple(param.shape), dtype)
    for rank in range(ckpt.manifest.world_size):
        start, end = _rank_part(flat, param, rank)
        if end > start:

            def read(first: int, count: int, name: str = name) -> torch.Tensor:
                return ckpt.read_param(name, tensor_of, first, count, optimizer)

            add_range(tensor, start, end - start, read)
    return tensor


def _rank_part(flat: FlatEntry, param: ParamEntry, rank: int) -> tuple[int, int]:
    """Elements ``[start, end)`` of the parameter (counted inside it) that ``rank``'s shard holds."""
    shard_start = rank * flat.shard_numel
    start = max(shard_start, param.offset)
    end = min(shard_start + flat.shard_numel, param.offset + param.numel)
    return start - param.offset, max(start, end) - param.offset


def _optimizer_states(ckpt: ShardedCheckpoint, optimizer: int) -> dict[str, dict[str, Any]]:
    """Optimizer ``optimizer``'s state by parameter: its per-element state as boxes and its scalar state (``step``),
    for every parameter it steps whose piece was stepped (a piece never stepped has no state, as in torch)."""
    states: dict[str, dict[str, Any]] = {}
    for flat in ckpt.manifest.flat_params:
        if optimizer not in flat.optimizers:
            continue
        names = ckpt.state_names(flat, optimizer)
        for param in flat.params:
            scalars = ckpt.scalar_state_at(flat, param.offset, optimizer)
            if not scalars and not names:
                continue
            state: dict[str, Any] = {n: _param_tensor(ckpt, param.name, f"optim:{n}", optimizer) for n in names}
            state.update({n: scalar_value(record, _CPU) for n, record in scalars.items()})
            states[param.name] = state
    return states


def _param_groups(ckpt: ShardedCheckpoint, trainer_state: dict[str, Any]) -> list[list[dict[str, Any]]]:
    members: dict[tuple[int, int], list[str]] = {}
    for flat in ckpt.manifest.flat_params:
        for param in flat.params:
            for optimizer, group in flat.group_of(param).items():
                members.setdefault((optimizer, group), []).append(param.name)
    return param_group_entries(trainer_state.get(PARAM_GROUPS_KEY, []), members)
