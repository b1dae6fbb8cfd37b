"""Writing a tensor-parallel checkpoint (layout: [Note: tensor-parallel checkpoint layout] in
checkpoint/sharded/tensor_parallel.py).

Sequence, over the whole world (each rank is in one data-parallel group, DP, and one tensor-parallel group, TP):
1. world rank 0 (DP rank 0 of TP coordinate 0) picks an id and the staging directory (a hidden sibling for a new
   checkpoint, a new ``v-<id>`` inside an existing one) and tells every rank: over its DP group, then each DP rank
   over its TP group;
2. each DP group writes its blocks as an ordinary sharded checkpoint into ``v-<id>/tp-<t>`` (save.py, with its
   group as its world: that step's own reports and outcome are agreed over the DP group);
3. every rank learns every coordinate's outcome (an all-gather over its TP group of its DP group's outcome);
4. only if all succeeded, world rank 0 writes ``tensor_parallel.json`` (the switch) and publishes; otherwise it
   removes the staging directory and the previous checkpoint stays as it was;
5. the outcome travels back as in step 1: no rank returns before the checkpoint is published.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from torch import Tensor

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, CheckpointError, Manifest
from zero_strategy.checkpoint.base.writable import WritableSource
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded
from zero_strategy.checkpoint.sharded.tensor_parallel import (
    TensorParallelManifest,
    describe_params,
    is_tensor_parallel_directory,
    part_name,
)
from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.plan.tensor_parallel import describe


def _plan_staging(target: Path, checkpoint_id: str) -> tuple[Path, bool]:
    """(the directory that becomes or already is the checkpoint, whether it is a new hidden sibling)."""
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is a file, not a tensor-parallel checkpoint directory.")
    if is_tensor_parallel_directory(target):
        root, fresh = target, False
    elif target.is_dir() and any(target.iterdir()):
        what = "a checkpoint without tensor parallelism" if (target / MANIFEST_NAME).is_file() else "other files"
        raise CheckpointError(f"{target} holds {what}; a tensor-parallel checkpoint cannot replace it in one step: "
                              "remove it or save under another name.")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        root, fresh = target.parent / f".{target.name}.partial-{checkpoint_id}", True
    (root / f"v-{checkpoint_id}").mkdir(parents=True)
    return root, fresh


def _from_world_leader(dp: Comm, tp: Comm, value: Any, label: str) -> Any:
    """World rank 0's ``value`` on every rank: over the DP group of TP coordinate 0, then over each TP group."""
    if tp.rank == 0:
        value = dp.broadcast_object(value, 0, label)
    return tp.broadcast_object(value, 0, label)


def save_tensor_parallel(
    engine: WritableSource, tensor: Comm, path: str | os.PathLike, trainer_state: dict[str, Any], info: SaveInfo
) -> None:
    """Collective over the world: every rank calls this with the same ``path``; ``tensor`` is its TP group."""
    dp, target = engine.comms.everyone, Path(path)
    leader = dp.rank == 0 and tensor.rank == 0
    planned: tuple[str, Path, bool] | str | None = None
    if leader:
        checkpoint_id = uuid.uuid4().hex[:12]
        try:
            planned = (checkpoint_id, *_plan_staging(target, checkpoint_id))
        except OSError as error:
            planned = f"cannot create a checkpoint at {target}: {error}"
        except CheckpointError as error:
            planned = str(error)
    planned = _from_world_leader(dp, tensor, planned, "tensor-parallel checkpoint staging")
    if not isinstance(planned, tuple):
        raise CheckpointError(str(planned))
    checkpoint_id, root, fresh = planned
    version_dir = root / f"v-{checkpoint_id}"
    failure: str | None = None
    try:  # every rank of this DP group gets the same outcome (save.py agrees on it)
        save_sharded(engine, version_dir / part_name(tensor.rank), trainer_state, info)
    except Exception as error:
        failure = f"TP coordinate {tensor.rank}: {type(error).__name__}: {error}"
    failures = [f for f in tensor.all_gather_object(failure, "tensor-parallel checkpoint reports") if f is not None]
    if leader and not failures:
        try:
            _publish(engine, info, (root, version_dir, fresh), target, (tensor.size, dp.size))
        except Exception as error:
            failures.append(f"rank 0 publishing: {type(error).__name__}: {error}")
    if leader and failures:
        shutil.rmtree(root if fresh else version_dir, ignore_errors=True)
    failures = _from_world_leader(dp, tensor, failures, "tensor-parallel checkpoint outcome")
    if failures:
        raise CheckpointError(f"saving {target} failed; the previous checkpoint is untouched: {'; '.join(failures)}")


def _stored_params(engine: WritableSource, renames: dict[str, str | None]) -> dict[str, dict[str, Any]]:
    """Each parameter's whole tensor under the name the parts store it (its first state-dict key that the save
    hooks left, as save.py names it), as ``describe`` records it (a plain parameter: its own shape, no placement)."""
    names = engine.parameter_names()
    stored: dict[int, tuple[str, Tensor]] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        new = renames.get(key, key)
        if new is not None and id(value) in names:
            stored.setdefault(id(value), (new, value))
    return {new: describe(value) or {"global_shape": list(value.shape), "placements": []}
            for new, value in stored.values()}


def _publish(
    engine: WritableSource, info: SaveInfo, staging: tuple[Path, Path, bool], target: Path, sizes: tuple[int, int]
) -> None:
    (root, version_dir, fresh), (tp_size, dp_size) = staging, sizes
    params = _stored_params(engine, info.key_renames)
    part_ids = [Manifest.from_file(version_dir / part_name(t) / MANIFEST_NAME).checkpoint_id for t in range(tp_size)]
    manifest = TensorParallelManifest(
        checkpoint_id=version_dir.name.removeprefix("v-"), version_dir=version_dir.name, tensor_parallel_size=tp_size,
        data_parallel_size=dp_size, part_ids=part_ids, params=describe_params(params),
    )
    manifest.write_atomically(root)
    if fresh:
        os.rename(root, target)
    for stale in target.glob("v-*"):
        if stale.name != version_dir.name:
            shutil.rmtree(stale, ignore_errors=True)
    os.utime(target)  # Lightning's ckpt_path="last" picks the newest by modification time
