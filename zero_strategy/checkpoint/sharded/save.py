"""Writing a sharded checkpoint: every rank writes its own shard, nothing is gathered onto one rank.

Sequence (see [Note: checkpoint layout] in checkpoint/base/format.py): rank 0 picks an id and a staging directory and
tells every rank; each rank writes its shard file; every rank reports success and file size; only if all succeeded does
rank 0 write the trainer state and the manifest, then publish (rename or manifest switch). A rank that dies leaves the
others waiting in the report step until the process-group timeout: nothing was published, the previous
checkpoint is intact.

With hybrid sharding (replicas of each shard group) every rank of the run takes part in these steps, but only the
first shard group writes shards: the others hold the same slices. The manifest then describes a world of K ranks,
and since loading reads by parameter name and element range, any layout (flat or hybrid, any world) can read it.
The replicas' generator states, which differ from the writers', travel to the first group's shard files (see
[Note: every rank's RNG is saved] in checkpoint/base/rng.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zero_strategy.checkpoint.base.format import (
    BUFFERS_KEY,
    MANIFEST_NAME,
    PARAM_GROUPS_KEY,
    TRAINER_STATE_NAME,
    CheckpointError,
    FlatEntry,
    Manifest,
    ParamEntry,
    shard_file_name,
)
from zero_strategy.checkpoint.base.rng import REPLICAS_METADATA_KEY, capture_rng, pack_replicas
from zero_strategy.checkpoint.base.safetensors_io import write_safetensors
from zero_strategy.checkpoint.base.writable import WritableSource
from zero_strategy.checkpoint.sharded.shard_content import collect_shard, encode_metadata
from zero_strategy.core.engine.optimizer import qualified_name

RngState = tuple[dict[str, torch.Tensor], str]  # capture_rng's (tensors, plain json)


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What the manifest records beyond the engine itself."""

    precision: str
    offload: dict[str, Any]
    versions: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)  # the manifest's free-form notes
    key_renames: dict[str, str | None] = field(default_factory=dict)
    """State-dict keys written under another name (None: left out), as a Lightning ``on_save_checkpoint`` hook
    edited them (see [Note: the state dict in Lightning's hooks] in lightning/hook_state_dict.py)."""


class _NothingToWrite(Exception):
    """A replica's rank: the first shard group writes the slices it holds."""


@dataclass(frozen=True, slots=True)
class _Staging:
    checkpoint_id: str
    root: Path  # the directory that becomes (or already is) the checkpoint
    version_dir: Path
    fresh: bool  # True: `root` is a hidden sibling renamed to the target at the end


def _plan_staging(path: Path) -> _Staging:
    checkpoint_id = uuid.uuid4().hex[:12]
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        root, fresh = path, False
    else:
        root, fresh = path.parent / f".{path.name}.partial-{checkpoint_id}", True
    version_dir = root / f"v-{checkpoint_id}"
    version_dir.mkdir(parents=True)
    return _Staging(checkpoint_id, root, version_dir, fresh)


def _manifest_entries(
    engine: WritableSource, renames: dict[str, str | None]
) -> tuple[list[FlatEntry], list[list[str]]]:
    """The FlatParams' entries and the state-dict keys, after ``renames`` (key → new key, None: left out): a
    parameter is stored under its first key that remains, and left out when none does (its values stay in the
    shard files, unnamed)."""
    names = engine.parameter_names()
    stored: dict[str, str] = {}  # canonical name -> the name the checkpoint gives the parameter
    keys: list[list[str]] = []
    for key, value in engine.module.state_dict(keep_vars=True).items():
        new = renames.get(key, key)
        if new is None:
            continue
        if id(value) in names:
            canonical = stored.setdefault(names[id(value)], new)
            keys.append([new, "param", canonical])
        else:
            keys.append([new, "buffer", new])
    flats: list[FlatEntry] = []
    for key, flat, optimizers in engine.named_flat_params():
        params = [
            ParamEntry(stored[span.name], list(span.shape), span.offset, span.numel, groups=list(groups))
            for span, groups in zip(flat.layout.spans, flat.param_groups, strict=True)
            if span.name in stored
        ]
        dtype = str(flat.shard.dtype).removeprefix("torch.")
        flats.append(FlatEntry(key, dtype, list(optimizers), flat.shard.numel(), params))
    return flats, keys


def _replicas_rng(engine: WritableSource, own: RngState) -> list[tuple[int, dict[str, torch.Tensor], str]]:
    """Collective over this rank's replica group (hybrid sharding; nothing to do otherwise): the generator states
    of the replicas whose shard file this rank writes, as ``(run rank, tensors, plain json)``; empty on a rank of
    another shard group, which writes nothing."""
    replicas = engine.comms.replicas
    if replicas is None or replicas.count == 1:
        return []
    mine = engine.comms.everyone.rank  # this rank's position among every rank of the run
    states = replicas.comm.all_gather_object((mine, *own), "generator states")
    return [state for state in states if state[0] != mine] if replicas.index == 0 else []


def save_sharded(
    engine: WritableSource, path: str | os.PathLike, trainer_state: dict[str, Any], info: SaveInfo
) -> None:
    """Collective: every rank of the engine's run (its group, and the replicas) calls this with the same ``path``."""
    place, everyone = engine.place, engine.comms.everyone
    target = Path(path)
    writes = place.replica_index == 0  # replicas hold the first shard group's slices
    leader = place.rank == 0 and writes
    planned: _Staging | str | None = None
    if leader:
        try:
            if target.exists() and not target.is_dir():
                raise CheckpointError(f"{target} exists and is a file, not a sharded checkpoint directory.")
            target.parent.mkdir(parents=True, exist_ok=True)
            planned = _plan_staging(target)
        except OSError as error:
            planned = f"cannot create a checkpoint at {target}: {error}"
        except CheckpointError as error:
            planned = str(error)
    planned = everyone.broadcast_object(planned, 0, "checkpoint staging")
    if not isinstance(planned, _Staging):
        raise CheckpointError(str(planned))
    staging = planned
    with_optimizer = "optimizer_states" in trainer_state
    rng_tensors, rng_json = capture_rng()
    replica_tensors, replica_json = pack_replicas(_replicas_rng(engine, (rng_tensors, rng_json)))
    report: tuple[bool, Any] = (True, None)
    try:
        if not writes:
            raise _NothingToWrite
        specs, tensors, scalars = collect_shard(engine, with_optimizer)
        rng_tensors = {**rng_tensors, **replica_tensors}
        specs += [(name, t.dtype, list(t.shape)) for name, t in rng_tensors.items()]
        metadata = encode_metadata(staging.checkpoint_id, place.rank, place.world_size, scalars, rng_json)
        if replica_tensors:  # a flat run's shard files stay as they were
            metadata[REPLICAS_METADATA_KEY] = replica_json
        all_tensors = itertools.chain(tensors, rng_tensors.values())
        size = write_safetensors(staging.version_dir / shard_file_name(place.rank), specs, all_tensors, metadata)
        report = (True, size)
    except _NothingToWrite:
        pass
    except Exception as error:  # every rank must reach the report step, or the others wait for nothing
        report = (False, f"rank {place.rank}: {type(error).__name__}: {error}")
    reports = everyone.all_gather_object(report, "checkpoint reports")
    failures = [message for ok, message in reports if not ok]
    sizes = [size for ok, size in reports if ok and size is not None]  # the writers', in rank order
    if leader and not failures:
        try:
            _publish(engine, target, staging, trainer_state, info, sizes, with_optimizer)
        except Exception as error:
            failures.append(f"rank 0 publishing: {type(error).__name__}: {error}")
    if leader and failures:
        shutil.rmtree(staging.root if staging.fresh else staging.version_dir, ignore_errors=True)
    failures = everyone.broadcast_object(failures, 0, "checkpoint outcome")  # nobody returns before it is published
    if failures:
        raise CheckpointError(f"saving {target} failed; the previous checkpoint is untouched: {'; '.join(failures)}")


def _publish(
    engine: WritableSource,
    target: Path,
    staging: _Staging,
    trainer_state: dict[str, Any],
    info: SaveInfo,
    shard_bytes: list[int],
    with_optimizer: bool,
) -> None:
    state_path = staging.version_dir / TRAINER_STATE_NAME
    flats, keys = _manifest_entries(engine, info.key_renames)
    # keep_vars: this runs on one rank, so it must not gather (a stage-3 state_dict() would: see
    # [Note: parameters outside forward]); only the buffers are read
    params = engine.parameter_names()
    buffers = {
        new: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # get_extra_state() may return plain data
        for k, v in engine.module.state_dict(keep_vars=True).items()
        if id(v) not in params and (new := info.key_renames.get(k, k)) is not None
    }
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in engine.optimizers]
    torch.save({**trainer_state, BUFFERS_KEY: buffers, PARAM_GROUPS_KEY: groups}, state_path)
    manifest = Manifest(
        checkpoint_id=staging.checkpoint_id,
        version_dir=staging.version_dir.name,
        world_size=engine.place.world_size,
        stage=int(engine.stage),
        precision=info.precision,
        offload=info.offload,
        versions=info.versions,
        flat_params=flats,
        state_dict_keys=keys,
        optimizers=[
            {"class": qualified_name(o), "param_groups": len(o.param_groups)} for o in engine.optimizers
        ],
        shard_bytes=shard_bytes,
        trainer_state_bytes=state_path.stat().st_size,
        has_optimizer_state=with_optimizer,
        extra=dict(info.extra),
    )
    manifest.write_atomically(staging.root)
    if staging.fresh:
        os.rename(staging.root, target)
    for stale in target.glob("v-*"):
        if stale.name != staging.version_dir.name:
            shutil.rmtree(stale, ignore_errors=True)
    os.utime(target)  # Lightning's ckpt_path="last" picks the newest by modification time
