"""Opening a sharded checkpoint: validate every file up front, then read any parameter's elements by name.

Reading is by *parameter name and element range*, whatever world size, stage or unit layout wrote the
checkpoint: that is what makes resharding (N ranks at stage s → M ranks at stage t) need no conversion step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import (
    MANIFEST_NAME,
    TRAINER_STATE_NAME,
    CheckpointError,
    FlatEntry,
    Manifest,
    ParamEntry,
    shard_file_name,
)
from zero_strategy.checkpoint.base.rng import REPLICAS_METADATA_KEY, is_own_entry, replica_prefix
from zero_strategy.checkpoint.base.safetensors_io import SafetensorsReader


class ShardedCheckpoint:
    """A validated checkpoint directory. Construction raises :class:`CheckpointError` naming the first bad file;
    nothing is read into any model before every file has been checked."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path} is a file, not a zero_strategy sharded checkpoint directory "
                "(a plain Lightning checkpoint can be loaded into the module before fitting with ZeRO)."
            )
        self.manifest = Manifest.from_file(self.path / MANIFEST_NAME)
        self.version_dir = self.path / self.manifest.version_dir
        self._readers: dict[int, SafetensorsReader] = {}
        self.params: dict[str, tuple[FlatEntry, ParamEntry]] = {
            param.name: (flat, param) for flat in self.manifest.flat_params for param in flat.params
        }
        self._validate_ranges()
        self._validate_files()

    def _validate_ranges(self) -> None:
        """Every parameter's range lies inside its FlatParam's shards and overlaps no other: a manifest that says
        otherwise (edited, or written by a faulty writer) would read the wrong elements or past the last shard."""
        manifest_path = self.path / MANIFEST_NAME
        for flat in self.manifest.flat_params:
            total = flat.shard_numel * self.manifest.world_size
            end_of_previous, previous = 0, None
            for param in sorted(flat.params, key=lambda p: p.offset):
                if param.offset < 0 or param.numel < 0 or param.offset + param.numel > total:
                    raise CheckpointError(
                        f"{manifest_path}: {param.name} is recorded at elements [{param.offset}, "
                        f"{param.offset + param.numel}) of {flat.key}, whose shards hold {total} "
                        f"({self.manifest.world_size} x {flat.shard_numel}): a damaged or foreign manifest"
                    )
                if param.offset < end_of_previous:
                    raise CheckpointError(
                        f"{manifest_path}: {param.name} (from element {param.offset}) overlaps {previous} (up to "
                        f"{end_of_previous}) in {flat.key}: a damaged or foreign manifest"
                    )
                end_of_previous, previous = param.offset + param.numel, param.name

    def _validate_files(self) -> None:
        state = self.version_dir / TRAINER_STATE_NAME
        if not state.is_file():
            raise CheckpointError(f"{state} is missing")
        if state.stat().st_size != self.manifest.trainer_state_bytes:
            raise CheckpointError(f"{state} has a different size than the manifest recorded: truncated or replaced")
        for rank in range(self.manifest.world_size):
            reader = self.reader(rank)  # checks presence, size and header
            if reader.metadata.get("checkpoint_id") != self.manifest.checkpoint_id:
                raise CheckpointError(
                    f"{reader.path} belongs to checkpoint {reader.metadata.get('checkpoint_id')!r}, not to "
                    f"{self.manifest.checkpoint_id!r} described by {self.path / MANIFEST_NAME}: a foreign shard"
                )
            if reader.metadata.get("rank") != str(rank):
                raise CheckpointError(
                    f"{reader.path} holds rank {reader.metadata.get('rank')}'s shard, not rank {rank}'s"
                )

    def reader(self, rank: int) -> SafetensorsReader:
        if rank not in self._readers:
            path = self.version_dir / shard_file_name(rank)
            self._readers[rank] = SafetensorsReader(path, self.manifest.shard_bytes[rank])
        return self._readers[rank]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- reading
    def read_flat_range(self, flat: FlatEntry, tensor: str, start: int, count: int) -> Tensor:
        """Elements ``[start, start+count)`` of a FlatParam's flat buffer, from whichever shards hold them.

        ``tensor`` is the name inside a shard file (weights or one optimizer state) for this FlatParam."""
        pieces: list[Tensor] = []
        while count > 0:
            rank, within = divmod(start, flat.shard_numel)
            take = min(count, flat.shard_numel - within)
            reader = self.reader(rank)
            if tensor in reader.entries:
                pieces.append(reader.read(tensor, within, take))
            else:  # that rank never created this optimizer state (its piece was never stepped): zeros
                pieces.append(torch.zeros(take, dtype=self._dtype_of(tensor)))
            start, count = start + take, count - take
        if not pieces:  # an empty range (a rank owning none of a parameter asks for zero elements)
            return torch.empty(0, dtype=self._dtype_of(tensor))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _dtype_of(self, tensor: str) -> torch.dtype:
        for rank in range(self.manifest.world_size):
            if tensor in self.reader(rank).entries:
                return self.reader(rank).entries_dtype(tensor)
        return torch.float32

    def read_param(
        self, name: str, tensor_of: str = "flat", start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        """Elements of parameter ``name`` (all of them by default), from its weights (``tensor_of="flat"``) or one
        optimizer state (``tensor_of="optim:<state name>"``) of optimizer ``optimizer`` (default: the first that
        steps it)."""
        flat, param = self.params[name]
        count = param.numel - start if count is None else count
        if tensor_of == "flat":
            tensor = f"flat/{flat.key}"
        else:
            state = tensor_of.removeprefix("optim:")
            tensor = self.manifest.state_tensor_name(flat, self._optimizer(flat, optimizer), state)
        return self.read_flat_range(flat, tensor, param.offset + start, count)

    @staticmethod
    def _optimizer(flat: FlatEntry, optimizer: int | None) -> int:
        if optimizer is None:
            if not flat.optimizers:
                raise CheckpointError(f"FlatParam {flat.key} is stepped by no optimizer: it has no optimizer state")
            return flat.optimizers[0]
        if optimizer not in flat.optimizers:
            raise CheckpointError(f"FlatParam {flat.key} is not stepped by optimizer {optimizer} ({flat.optimizers})")
        return optimizer

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        """Per-element state names optimizer ``optimizer`` (default: the first that steps it) stored for a
        FlatParam (union over ranks)."""
        if not flat.optimizers:
            return []
        prefix = self.manifest.state_tensor_name(flat, self._optimizer(flat, optimizer), "")
        names: set[str] = set()
        for rank in range(self.manifest.world_size):
            names |= {n.removeprefix(prefix) for n in self.reader(rank).entries if n.startswith(prefix)}
        return sorted(names)

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        """Scalar state (e.g. ``step``) optimizer ``optimizer`` (default: the first that steps the FlatParam) keeps
        for the piece that held flat element ``position``."""
        if not flat.optimizers:
            return {}
        wanted = self._optimizer(flat, optimizer)
        rank, within = divmod(position, flat.shard_numel)
        records = json.loads(self.reader(rank).metadata.get("scalars", "{}")).get(flat.key, [])
        for record in records:
            mine = record.get("optimizer", wanted) == wanted  # version 1: one optimizer, not named
            if mine and record["offset"] <= within < record["offset"] + record["numel"]:
                return dict(record["state"])
        return {}

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        """The generator states saved by rank ``rank`` of the saving run (its position among every rank, the
        replicas of hybrid sharding included), or None when that run had no such rank; see [Note: every rank's
        RNG is saved] in checkpoint/base/rng.py."""
        for shard in range(self.manifest.world_size):  # a replica's states travel in a first-group shard
            reader = self.reader(shard)
            carried = json.loads(reader.metadata.get(REPLICAS_METADATA_KEY, "{}"))
            if str(rank) in carried:
                prefix = replica_prefix(rank)
                names = [name for name in reader.entries if name.startswith(prefix)]
                return {"rng/" + name.removeprefix(prefix): reader.read(name) for name in names}, carried[str(rank)]
        if rank >= self.manifest.world_size:
            return None
        reader = self.reader(rank)
        tensors = {name: reader.read(name) for name in reader.entries if is_own_entry(name)}
        return tensors, reader.metadata.get("rng", "{}")

    def trainer_state(self, weights_only: bool | None = True) -> dict[str, Any]:
        """Lightning's non-tensor state. Loaded with ``weights_only=True`` unless the caller says otherwise, as
        Lightning does for its own checkpoints; the shard files never need pickle."""
        path = self.version_dir / TRAINER_STATE_NAME
        safe = True if weights_only is None else weights_only
        try:
            return dict(torch.load(path, map_location="cpu", weights_only=safe))
        except Exception as error:
            hint = (
                " It holds objects beyond plain data (often hyper-parameters such as a dataclass); if you trust "
                "this checkpoint, pass weights_only=False (e.g. trainer.fit(..., weights_only=False))."
                if safe
                else ""
            )
            raise CheckpointError(f"{path} could not be loaded (weights_only={safe}): {error}.{hint}") from error
