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
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
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


@dataclass(slots=True)
class ParamEntry:
    name: str  # canonical name (first in the module's traversal)
    shape: list[int]
    offset: int  # in the flat buffer
    numel: int
    group_index: int | None  # optimizer param group, None if not optimized


@dataclass(slots=True)
class FlatEntry:
    key: str  # "<unit path>/<index>"
    dtype: str  # dtype of the stored shard ("float32")
    optimizer_index: int | None
    shard_numel: int  # per rank, padding included
    params: list[ParamEntry]


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
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: checkpoint format version {version!r} is not supported by this zero_strategy "
                f"(it reads version {FORMAT_VERSION}); upgrade or downgrade zero_strategy to the version that wrote it "
                f"({raw.get('versions', {}).get('zero_strategy', 'unknown')})."
            )
        try:
            raw["flat_params"] = [
                FlatEntry(**{**f, "params": [ParamEntry(**p) for p in f["params"]]}) for f in raw["flat_params"]
            ]
            return Manifest(**raw)
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"{path}: malformed manifest ({error})") from error

    def write_atomically(self, directory: Path) -> None:
        """Write ``manifest.json`` with one rename, so readers see the old manifest or the new one, never half."""
        tmp = directory / f".{MANIFEST_NAME}.tmp"
        with open(tmp, "w") as handle:
            handle.write(self.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / MANIFEST_NAME)
