"""Reading a ``torch.distributed.checkpoint`` directory by parameter name and element range — ours, FSDP2's,
Lightning's or torchtitan's (see [Note: reading other tools' DCP layouts] in checkpoint/dcp/keys.py).

:class:`DcpCheckpoint` answers the questions checkpoint/sharded/load.py asks of our own ``ShardedCheckpoint``: elements
``[start, start + count)`` of parameter NAME's weights or of one of its optimizer states (``read_param``), the
state names and scalar state (``step``) of a parameter, a rank's RNG state, the trainer state. A range is cut into
boxes (boxes.py) and each box is filled from the stored chunks it intersects, through torch's own
``FileSystemReader.read_data`` (one stored chunk is deserialized at a time), so a rank reads only the chunks that
overlap its ranges. Each parameter is presented as a flat entry of its own (offset 0), which is all load.py needs.

Opening a DCP checkpoint unpickles its ``.metadata`` (torch's format is a pickle): open only checkpoints you trust.
Everything else (tensors, hyper-parameters, the trainer state) is loaded with ``weights_only=True`` unless the
caller says otherwise.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zero_strategy.checkpoint.base.format import CheckpointError, FlatEntry, ParamEntry
from zero_strategy.checkpoint.dcp.boxes import range_boxes
from zero_strategy.checkpoint.dcp.content import INFO, OURS, PARAMS, RNG, TRAINER_STATE, from_bytes
from zero_strategy.checkpoint.dcp.keys import DcpKeys, OptimizerKeys, find_keys
from zero_strategy.checkpoint.dcp.paths import LIGHTNING_META_NAME, METADATA_NAME

WEIGHTS = "flat"  # ``tensor_of`` for a parameter's weights, as ShardedCheckpoint.read_param names it


class _Receiver(DefaultLoadPlanner):
    """Where ``FileSystemReader.read_data`` puts what it reads: tensor boxes into the destination views given
    (``dest_index.index`` numbers them), objects into :attr:`objects` (``weights_only`` unpickling)."""

    def __init__(self, destinations: list[Tensor], weights_only: bool = True) -> None:
        super().__init__()
        self._destinations = destinations
        self._weights_only = weights_only
        self.objects: dict[str, Any] = {}
        self.filled = 0  # elements copied into the destinations

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        target = self._destinations[read_item.dest_index.index or 0]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        self.filled += tensor.numel()

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, map_location="cpu", weights_only=self._weights_only)


class DcpCheckpoint:
    """A DCP checkpoint directory, validated (``.metadata`` readable, every data file present and long enough)
    before anything is read. ``expected``: the module's state_dict keys, when known (picks the model's prefix)."""

    def __init__(self, path: str | os.PathLike, expected: Collection[str] | None = None) -> None:
        self.path = Path(path)
        if not (self.path / METADATA_NAME).is_file():
            raise CheckpointError(
                f"{self.path} is not a torch.distributed.checkpoint directory: {METADATA_NAME} is missing (a save that "
                "did not finish, or another kind of checkpoint)."
            )
        self._storage = FileSystemReader(self.path)
        try:
            self.metadata = self._storage.read_metadata()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as error:
            raise CheckpointError(f"{self.path / METADATA_NAME} could not be read: {error}") from error
        self._storage.set_up_storage_reader(self.metadata, is_coordinator=False)
        self._entries = self.metadata.state_dict_metadata
        self._check_files()
        self.keys: DcpKeys = find_keys(self._entries, expected)
        self.params: dict[str, tuple[FlatEntry, ParamEntry]] = {
            name: _entry(name, self._tensor_md(key)) for name, key in self.keys.model.items()
        }
        self._cached_groups: dict[int | None, list[tuple[dict[str, Any], list[str]]]] = {}

    def _check_files(self) -> None:
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in needed.items():
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing; {self.path / METADATA_NAME} lists data in it")
            if file.stat().st_size < end:
                raise CheckpointError(
                    f"{file} is truncated: {file.stat().st_size} bytes, {self.path / METADATA_NAME} lists data up "
                    f"to byte {end}"
                )

    def _tensor_md(self, key: str) -> TensorStorageMetadata:
        md = self._entries[key]
        assert isinstance(md, TensorStorageMetadata)
        return md

    def _state_of(self, name: str, optimizer: int | None) -> dict[str, str]:
        """{state name: stored key} of parameter ``name``'s state in optimizer ``optimizer`` (None: whichever
        optimizer holds it), from the one root that serves that optimizer and holds it (see [Note: reading other
        tools' DCP layouts] in checkpoint/dcp/keys.py); empty when there is none."""
        roots = [keys for keys in self.keys.optimizers if name in keys.state]
        if optimizer is not None:
            own = [keys for keys in roots if keys.serves == optimizer]
            roots = own or [keys for keys in roots if keys.serves is None]
        if len(roots) > 1:
            which = "name the optimizer to read" if optimizer is None else f"none of them is optimizer {optimizer}'s"
            raise CheckpointError(
                f"{self.path}: parameter {name!r} has optimizer state under several roots "
                f"({', '.join(repr(keys.root) for keys in roots)}): {which}"
            )
        return roots[0].state[name] if roots else {}

    # ------------------------------------------------------------------------------------------- tensors
    def read_param(
        self, name: str, tensor_of: str = WEIGHTS, start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        """Elements of parameter ``name`` (all of them by default), from its weights (``tensor_of="flat"``) or an
        optimizer state (``"optim:<state name>"``) of optimizer ``optimizer``: a new 1-D CPU tensor of the stored
        dtype. An optimizer state the checkpoint does not hold for ``name`` reads as zeros (a parameter never
        stepped), as in our format."""
        param = self.params[name][1]
        count = param.numel - start if count is None else count
        if tensor_of == WEIGHTS:
            return self.read_tensor(self.keys.model[name], start, count)
        state_name = tensor_of.removeprefix("optim:")
        key = self._state_of(name, optimizer).get(state_name)
        if key is None:
            return torch.zeros(count, dtype=self._state_dtype(state_name))
        return self.read_tensor(key, start, count)

    def read_tensor(self, key: str, start: int, count: int) -> Tensor:
        """Elements ``[start, start + count)`` of stored tensor ``key``'s row-major flattening."""
        md = self._tensor_md(key)
        out = torch.empty(count, dtype=md.properties.dtype)
        boxes = range_boxes(tuple(md.size), start, count)
        if not boxes:
            return out
        views = [out[box.range_start : box.range_start + box.numel].view(box.sizes) for box in boxes]
        chunks = [ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)) for box in boxes]
        receiver = _Receiver(views)
        self._storage.read_data(LoadPlan(create_read_items_for_chunk_list(key, md, chunks)), receiver).wait()
        if receiver.filled != count:  # stored chunks with a gap: never hand back uninitialized memory
            raise CheckpointError(
                f"{self.path}: the stored chunks of {key!r} cover {receiver.filled} of elements [{start}, "
                f"{start + count}), not all of them"
            )
        return out

    def read_objects(self, keys: Collection[str], weights_only: bool = True) -> dict[str, Any]:
        """Stored non-tensor items (bytes records) by key."""
        items = [
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(key),
                dest_offsets=torch.Size((0,)),
                storage_index=MetadataIndex(key),
                storage_offsets=torch.Size((0,)),
                lengths=torch.Size((0,)),
            )
            for key in keys
        ]
        receiver = _Receiver([], weights_only)
        if items:
            self._storage.read_data(LoadPlan(items), receiver).wait()
        return receiver.objects

    def _state_dtype(self, state_name: str) -> torch.dtype:
        for keys in self.keys.optimizers:
            for names in keys.state.values():
                if state_name in names:
                    return self._tensor_md(names[state_name]).properties.dtype
        return torch.float32

    # ------------------------------------------------------------------------------------- optimizer state
    @property
    def has_optimizer_state(self) -> bool:
        return any(keys.state for keys in self.keys.optimizers)

    def stored_state(self, name: str, optimizer: int | None = None) -> tuple[list[str], dict[str, str]]:
        """(per-element state names, {scalar state name: stored key}) the checkpoint holds for parameter ``name``
        in optimizer ``optimizer``."""
        shape = self.params[name][1].shape
        per_element, scalars = [], {}
        for state_name, key in sorted(self._state_of(name, optimizer).items()):
            md = self._entries[key]
            if isinstance(md, TensorStorageMetadata) and len(md.size) > 0 and list(md.size) == list(shape):
                per_element.append(state_name)
            else:
                scalars[state_name] = key
        return per_element, scalars

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        """Per-element state names of optimizer ``optimizer`` for the parameter ``flat`` stands for (see
        :meth:`_state_source`)."""
        return self._state_source(flat.key, optimizer)[0]

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        """Scalar state (``step``) of optimizer ``optimizer`` for the parameter ``flat`` stands for (one value per
        parameter, so ``position`` does not matter)."""
        return self.read_scalars(self._state_source(flat.key, optimizer)[1])

    def _state_source(self, name: str, optimizer: int | None) -> tuple[list[str], dict[str, str]]:
        """The parameter's own state; for a parameter the checkpoint holds no state for (never stepped, e.g.
        unused), the names and scalar state of another parameter of its param group: a ZeRO master piece holds
        several parameters and one ``step``, so the piece keeps its neighbours' step and this parameter's part of
        the per-element state reads as zeros (as our own format stores a piece never stepped)."""
        own = self.stored_state(name, optimizer)
        if own[0] or own[1]:
            return own
        for _, members in self._groups(optimizer):
            if name in members:
                for other in members:
                    if other in self.params and self._state_of(other, optimizer):
                        return self.stored_state(other, optimizer)
        return [], {}

    def _groups(self, optimizer: int | None) -> list[tuple[dict[str, Any], list[str]]]:
        if optimizer not in self._cached_groups:
            self._cached_groups[optimizer] = self.param_groups(optimizer)
        return self._cached_groups[optimizer]

    def read_scalars(self, keys: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Scalar state as the records ``shard_content.scalar_value`` turns back into values."""
        records: dict[str, dict[str, Any]] = {}
        for state_name, key in keys.items():
            md = self._entries[key]
            if isinstance(md, BytesStorageMetadata):
                records[state_name] = {"value": self.read_objects([key])[key], "tensor": False}
            else:
                value = self.read_tensor(key, 0, 1)
                dtype = str(value.dtype).removeprefix("torch.")
                records[state_name] = {"value": value.item(), "tensor": True, "dtype": dtype}
        return records

    def param_groups(self, optimizer: int | None = None) -> list[tuple[dict[str, Any], list[str]]]:
        """The stored param groups of optimizer ``optimizer`` (None: of every optimizer) as (hyper-parameters,
        parameter fqns), roots in order; torchtitan's flattened layout gives one group per parameter."""
        roots = [keys for keys in self.keys.optimizers if optimizer is None or keys.serves in (None, optimizer)]
        groups: list[tuple[dict[str, Any], list[str]]] = []
        for keys in roots:
            groups += _groups_of(keys, self.read_objects(_group_keys(keys)))
        return groups

    # ------------------------------------------------------------------------------------ trainer state
    @property
    def info(self) -> dict[str, Any] | None:
        """What our own writer recorded (world size, stage, optimizers), or None for another tool's checkpoint."""
        key = f"{OURS}.{INFO}"
        return json.loads(self.read_objects([key])[key]) if key in self._entries else None

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        key = f"{OURS}.{RNG}.{rank}"
        if key not in self._entries:
            return None
        record = from_bytes(self.read_objects([key])[key])
        return record["tensors"], record["plain"]

    def has_trainer_state(self) -> bool:
        return f"{OURS}.{TRAINER_STATE}" in self._entries or (self.path / LIGHTNING_META_NAME).is_file()

    def trainer_state(self, weights_only: bool | None = True) -> dict[str, Any]:
        """Lightning's trainer state: ours (``zero_strategy.trainer_state``), else Lightning's ``meta.pt``
        beside the DCP files, else empty."""
        safe = True if weights_only is None else weights_only
        key = f"{OURS}.{TRAINER_STATE}"
        try:
            if key in self._entries:
                return dict(from_bytes(self.read_objects([key])[key], safe))
            meta = self.path / LIGHTNING_META_NAME
            if meta.is_file():
                return dict(torch.load(meta, map_location="cpu", weights_only=safe))
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"{self.path}: the trainer state could not be loaded with weights_only={safe}: {error}. It holds "
                "objects beyond plain data (often hyper-parameters); if you trust this checkpoint, pass "
                "weights_only=False (e.g. trainer.fit(..., weights_only=False))."
            ) from error
        return {}

    def close(self) -> None:
        """Nothing stays open between reads (each read opens and closes its files)."""

    def __enter__(self) -> DcpCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _entry(name: str, md: TensorStorageMetadata) -> tuple[FlatEntry, ParamEntry]:
    """A parameter as a flat entry of its own: offsets count inside the parameter."""
    numel = 1
    for dim in md.size:
        numel *= dim
    param = ParamEntry(name=name, shape=list(md.size), offset=0, numel=numel, groups=[])
    dtype = str(md.properties.dtype).removeprefix("torch.")
    return FlatEntry(key=name, dtype=dtype, optimizers=[], shard_numel=numel, params=[param]), param


def _group_keys(optimizer: OptimizerKeys) -> list[str]:
    keys = [key for names in optimizer.nested_groups.values() for key in names.values()]
    return keys + [key for names in optimizer.flat_groups.values() for key in names.values()]


def _groups_of(optimizer: OptimizerKeys, values: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    groups = []
    for _, names in sorted(optimizer.nested_groups.items()):
        hyper = {name: values[key] for name, key in names.items() if name != PARAMS}
        groups.append((hyper, list(values[names[PARAMS]])))
    for fqn, names in optimizer.flat_groups.items():
        groups.append(({name: values[key] for name, key in names.items()}, [fqn]))
    return groups
