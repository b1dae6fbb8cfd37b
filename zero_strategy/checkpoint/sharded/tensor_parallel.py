"""A checkpoint of a tensor-parallel run: one data-parallel checkpoint per tensor-parallel coordinate.

[Note: tensor-parallel checkpoint layout]
With ``tensor_parallel_size=K`` every rank's engine is a data-parallel engine over the *local* blocks of its
parameters (see [Note: ZeRO over the data-parallel dimension of a 2-D mesh] in core/plan/tensor_parallel.py), and
the ranks sharing TP coordinate ``t`` hold the same blocks. So each such data-parallel group writes an ordinary
sharded checkpoint of its blocks (the existing writer, its group as its world), and one file above them says how
the blocks make the whole tensors::

    PATH/tensor_parallel.json          TP size, each parameter's global shape and placements; written last
    PATH/v-<id>/tp-0/                  an ordinary sharded checkpoint (manifest.json, v-<id2>/shard-*.safetensors)
    PATH/v-<id>/tp-1/                  ...

The ``v-<id>`` level keeps the save atomic across TP coordinates as save.py keeps it across ranks: a new checkpoint
is staged in a hidden sibling renamed onto ``PATH`` at the end, and overwriting one writes a new ``v-<id>`` and
switches ``tensor_parallel.json`` to it with one ``os.replace``, after every rank of the world reported success.
Without that level each coordinate's own checkpoint would switch on its own, and a crash between two switches
would leave coordinates of different steps.

Resuming at the same TP size reads ``tp-<t>`` as an ordinary checkpoint, so any data-parallel size resumes from it
(checkpoint/sharded/load.py reads by name and element range). A parameter's whole tensor is its blocks
concatenated along the sharded dimension in TP order (``Shard(d)``), or coordinate 0's block (``Replicate()``):
checkpoint/sharded/tensor_parallel_view.py reads it so, for ``zero-to-fp32`` and for a run without tensor
parallelism; checkpoint/sharded/tensor_parallel_blocks.py reads those whole tensors as the blocks of a run at
another TP size (and picks what a run reads: ``open_for_run``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zero_strategy.checkpoint.base.format import CheckpointError, write_text_atomically
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint

TP_MANIFEST_NAME = "tensor_parallel.json"
TP_FORMAT_VERSION = 1
_SHARD = re.compile(r"Shard\(dim=(\d+)\)")


def part_name(coordinate: int) -> str:
    """The directory (inside the version directory) of TP coordinate ``coordinate``'s checkpoint."""
    return f"tp-{coordinate}"


def is_tensor_parallel_directory(path: Path) -> bool:
    return path.is_dir() and (path / TP_MANIFEST_NAME).is_file()


@dataclass(frozen=True, slots=True)
class TensorParallelParam:
    """A parameter's whole tensor, as ``core/plan/tensor_parallel.describe`` records it."""

    global_shape: list[int]
    placements: list[str]  # repr of each placement over the TP dimension; empty: a plain (replicated) parameter

    def sharded_dim(self) -> int | None:
        """The dimension the TP ranks split (``Shard(d)``), None when every rank holds the whole tensor; a
        placement this reader does not know raises (never a silently wrong tensor)."""
        dims = []
        for placement in self.placements:
            match = _SHARD.fullmatch(placement)
            if match is not None:
                dims.append(int(match.group(1)))
            elif placement != "Replicate()":
                raise CheckpointError(f"placement {placement} is not one a tensor-parallel checkpoint can be read "
                                      "with (Shard(d) or Replicate() over one mesh dimension)")
        if len(dims) > 1:
            raise CheckpointError(f"placements {self.placements}: a parameter sharded over several mesh dimensions")
        return dims[0] if dims else None


@dataclass(frozen=True, slots=True)
class TensorParallelManifest:
    checkpoint_id: str
    version_dir: str
    tensor_parallel_size: int
    data_parallel_size: int
    part_ids: list[str]  # each part's own checkpoint id, in TP order (a foreign part is refused)
    params: dict[str, TensorParallelParam]  # canonical name -> its whole tensor
    format_version: int = TP_FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def read(directory: Path) -> TensorParallelManifest:
        path = directory / TP_MANIFEST_NAME
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path} is not readable JSON: {error}") from error
        if raw.get("format_version") != TP_FORMAT_VERSION:
            raise CheckpointError(f"{path}: tensor-parallel checkpoint format {raw.get('format_version')!r} is not "
                                  f"supported by this zero_strategy (it reads version {TP_FORMAT_VERSION})")
        try:
            raw["params"] = {name: TensorParallelParam(**entry) for name, entry in raw["params"].items()}
            return TensorParallelManifest(**raw)
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"{path}: malformed tensor-parallel manifest ({error})") from error

    def write_atomically(self, directory: Path) -> None:
        """One ``os.replace``: readers see the previous checkpoint or this one, never a mix of TP coordinates."""
        write_text_atomically(directory, TP_MANIFEST_NAME, self.to_json())


def open_part(path: Path, coordinate: int) -> ShardedCheckpoint:
    """TP coordinate ``coordinate``'s checkpoint inside the tensor-parallel checkpoint ``path``, validated (its
    files, and that it is the part the manifest names)."""
    manifest = TensorParallelManifest.read(path)
    if not 0 <= coordinate < manifest.tensor_parallel_size:
        raise CheckpointError(f"{path} has TP coordinates 0..{manifest.tensor_parallel_size - 1}, not {coordinate}")
    part = ShardedCheckpoint(path / manifest.version_dir / part_name(coordinate))
    if part.manifest.checkpoint_id != manifest.part_ids[coordinate]:
        part.close()
        raise CheckpointError(f"{part.path} is checkpoint {part.manifest.checkpoint_id!r}, not the part "
                              f"{manifest.part_ids[coordinate]!r} that {path / TP_MANIFEST_NAME} names: a foreign part")
    return part


def describe_params(named: dict[str, dict[str, Any]]) -> dict[str, TensorParallelParam]:
    """``core/plan/tensor_parallel.describe``'s records by name, as the manifest stores them."""
    return {name: TensorParallelParam(list(d["global_shape"]), list(d["placements"])) for name, d in named.items()}
