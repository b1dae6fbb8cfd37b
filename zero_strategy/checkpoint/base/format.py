"""The on-disk format of a sharded checkpoint.

[Note: checkpoint layout]
A checkpoint is a directory::

    PATH/manifest.json                 what is where; written last, by one atomic rename
    PATH/v-<id>/shard-00000.safetensors  rank 0's slices: master weights, optimizer state, RNG (no pickle)
    PATH/v-<id>/shard-00001.safetensors  ...
    PATH/v-<id>/trainer_state.pt       Lightning's loops, callbacks, schedulers, precision state, buffers

A new checkpoint is built under a hidden sibling ``.NAME.partial-<id>`` and renamed to ``PATH`` when every rank
has finished; overwriting an existing checkpoint writes a new ``v-<id>`` inside it and switches
``manifest.json`` to it with one ``os.replace``. Either way a crash at any moment leaves the previous checkpoint
complete and loadable, and Lightning's ``last`` lookup (``last*.ckpt``) never sees a partial one.

[Note: format versions]
Version 2 lets several optimizers step one FlatParam (see [Note: optimizers sharing parameters] in
core/engine/window.py): a FlatParam lists the optimizers that step it, a parameter its param group in each, and
per-element optimizer state is stored per optimizer (``optim/<optimizer>/<key>/<name>``; scalar records name their
optimizer). Version 1 (one optimizer per FlatParam: ``optimizer_index``, ``group_index``, ``optim/<key>/<name>``)
is still read: its manifest is translated on opening, and its state names are its one optimizer's. A reader that
only knows version 1 refuses version 2 with a message naming both versions (its check below), instead of reading
one optimizer's state as everyone's. Every checkpoint is written as version 2, with or without shared parameters:
one writer, one layout to test.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # see [Note: format versions]
MANIFEST_NAME = "manifest.json"
TRAINER_STATE_NAME = "trainer_state.pt"
# Keys the saver adds to the trainer state: non-parameter entries of the module's state_dict (buffers, extra
# state) and the optimizers' param-group hyper-parameters (schedulers move the learning rate).
BUFFERS_KEY = "zero_module_buffers"
PARAM_GROUPS_KEY = "zero_optimizer_param_groups"
NO_OPTIMIZER_STATE_KEY = "optimizer_state_absent"
"""Manifest ``extra`` key: why a checkpoint holds no optimizer state (shown when a resume asks for it)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked: the message names the file and what is wrong."""


def shard_file_name(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def state_name(key: str, optimizer: int, name: str) -> str:
    """A shard file's tensor holding optimizer ``optimizer``'s per-element state ``name`` of FlatParam ``key``."""
    return f"optim/{optimizer}/{key}/{name}"


def _from_version_1(flat: dict[str, Any]) -> dict[str, Any]:
    """A version-1 manifest's FlatParam entry in version 2's terms (see [Note: format versions])."""
    flat = dict(flat)
    optimizer = flat.pop("optimizer_index")
    flat["optimizers"] = [] if optimizer is None else [optimizer]
    params = []
    for param in flat["params"]:
        param = dict(param)
        group = param.pop("group_index")
        param["groups"] = [] if group is None else [group]
        params.append(param)
    flat["params"] = params
    return flat


@dataclass(slots=True)
class ParamEntry:
    name: str  # canonical name (first in the module's traversal)
    shape: list[int]
    offset: int  # in the flat buffer
    numel: int
    groups: list[int]  # its param group in each optimizer of its FlatEntry's ``optimizers`` (empty: not optimized)


@dataclass(slots=True)
class FlatEntry:
    key: str  # "<unit path>/<index>"
    dtype: str  # dtype of the stored shard ("float32")
    optimizers: list[int]  # the optimizers that step it, ascending (empty: none)
    shard_numel: int  # per rank, padding included
    params: list[ParamEntry]

    def group_of(self, param: ParamEntry) -> dict[int, int]:
        """``param``'s param group by optimizer index."""
        return dict(zip(self.optimizers, param.groups, strict=True))


@dataclass(slots=True)
class Manifest:
    checkpoint_id: str
    version_dir: str
    world_size: int
    stage: int
    precision: str
    offload: dict[str, Any]
    versions: dict[str, str]  # library, torch, lightning
    flat_params: list[FlatEntry]
    state_dict_keys: list[list[str]]  # [key, "param"|"buffer", canonical parameter name or buffer key]
    optimizers: list[dict[str, Any]]  # class name and the number of param groups, per optimizer
    shard_bytes: list[int]  # size of each rank's shard file, to detect truncation
    trainer_state_bytes: int
    has_optimizer_state: bool
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_file(path: Path) -> Manifest:
        if not path.is_file():
            raise CheckpointError(
                f"{path.parent} is not a complete sharded checkpoint: {path.name} is missing (a save that did "
                "not finish, or not a zero_strategy checkpoint)."
            )
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path} is not readable JSON: {error}") from error
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{path}: checkpoint format version {version!r} is not supported by this zero_strategy "
                f"(it reads versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade or downgrade zero_strategy to "
                f"the version that wrote it ({raw.get('versions', {}).get('zero_strategy', 'unknown')})."
            )
        try:
            flats = raw["flat_params"]
            if version == 1:
                flats = [_from_version_1(flat) for flat in flats]
            raw["flat_params"] = [
                FlatEntry(**{**f, "params": [ParamEntry(**p) for p in f["params"]]}) for f in flats
            ]
            return Manifest(**raw)
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"{path}: malformed manifest ({error})") from error

    def state_tensor_name(self, flat: FlatEntry, optimizer: int, state: str) -> str:
        """The shard files' name of optimizer ``optimizer``'s per-element state ``state`` of ``flat``."""
        if self.format_version == 1:  # one optimizer per FlatParam (see [Note: format versions])
            return f"optim/{flat.key}/{state}"
        return state_name(flat.key, optimizer, state)

    def write_atomically(self, directory: Path) -> None:
        """Write ``manifest.json`` with one rename, so readers see the old manifest or the new one, never half."""
        write_text_atomically(directory, MANIFEST_NAME, self.to_json())


def write_text_atomically(directory: Path, name: str, text: str) -> None:
    """``directory/name`` holds ``text`` after one rename: readers see the old file or the new one, never half."""
    tmp = directory / f".{name}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / name)
    fsync_directory(directory)  # the rename survives a power loss too, as the other writers' renames do


def fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
