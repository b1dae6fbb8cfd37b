"""Where pretrained tensors come from: one class per kind of file, each reading any element range of a tensor by
its key in the file, in the stored dtype, without loading a whole file.

[Note: pretrained reads stay small]
- safetensors: the header gives each tensor's byte offsets; a range is one seek and one ``readinto`` of exactly
  its bytes (``SafetensorsReader``), so nothing else of the file enters the process.
- torch files (``.pt`` / ``.bin`` / ``.ckpt``): ``torch.load(mmap=True, weights_only=True)`` maps the zip's
  storages without reading them; slicing a mapped tensor touches only the pages of the range, and those pages are
  the kernel's page cache (clean, shared, evictable), not memory the process allocated.
- this project's sharded checkpoints: ``ShardedCheckpoint.read_param`` reads the range from whichever rank's
  shard holds it (fp32 masters); buffers live whole in ``trainer_state.pt`` (small), loaded memory-mapped.
- an HF index (``*.index.json``): each shard is one of the above, opened up front so a missing shard fails
  before anything is loaded.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import BUFFERS_KEY, TRAINER_STATE_NAME, CheckpointError
from zero_strategy.checkpoint.base.safetensors_io import CODE_DTYPES, SafetensorsReader
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.tensor_parallel import is_tensor_parallel_directory
from zero_strategy.checkpoint.sharded.tensor_parallel_view import TensorParallelView

SAFETENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class TensorStore(ABC):
    """Tensors of one source by their key *in the file*. ``read`` gets a range already checked against the shape
    (``PretrainedSource`` checks it) and returns a new 1-D tensor of the stored dtype."""

    path: Path

    @abstractmethod
    def keys(self) -> list[str]: ...

    @abstractmethod
    def shape(self, key: str) -> tuple[int, ...]: ...

    @abstractmethod
    def dtype(self, key: str) -> torch.dtype: ...

    @abstractmethod
    def read(self, key: str, start: int, count: int) -> Tensor: ...

    def close(self) -> None:  # noqa: B027 - most stores hold nothing to release
        pass


class SafetensorsStore(TensorStore):
    """One ``.safetensors`` file, read range by range with plain file reads (see [Note: pretrained reads stay
    small])."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = SafetensorsReader(path)
        try:
            self._check_entries()
        except BaseException:
            self._reader.close()
            raise

    def _check_entries(self) -> None:
        """Each tensor's byte span must hold exactly its shape's elements: a range is read by offset arithmetic,
        so a wrong span would read a neighbour's bytes."""
        for key, entry in self._reader.entries.items():
            dtype = CODE_DTYPES.get(str(entry.get("dtype")))
            if dtype is None:  # an exotic dtype is an error only if that tensor is used (see dtype())
                continue
            begin, end = entry["data_offsets"]
            expected = self._reader.numel(key) * torch.empty((), dtype=dtype).element_size()
            if end - begin != expected:
                raise CheckpointError(
                    f"{self.path} is damaged: tensor {key!r} ({entry['dtype']} {entry['shape']}) should span "
                    f"{expected} bytes, its header says {end - begin}"
                )

    def keys(self) -> list[str]:
        return list(self._reader.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._reader.entries[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        code = self._reader.entries[key]["dtype"]
        if code not in CODE_DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {key!r} has dtype {code}, which zero_strategy does not read "
                f"(it reads {', '.join(CODE_DTYPES)}); drop the key with key_map or convert the file"
            )
        return CODE_DTYPES[code]

    def read(self, key: str, start: int, count: int) -> Tensor:
        self.dtype(key)  # a clear error for an unsupported dtype
        return self._reader.read(key, start, count)

    def close(self) -> None:
        self._reader.close()


class TorchFileStore(TensorStore):
    """A ``torch.save``'d state_dict, or a Lightning checkpoint (tensors under ``"state_dict"``), memory-mapped.

    [Note: torch files load with weights_only=True and mmap=True]
    ``weights_only=True`` because a downloaded file must never run code: a file whose pickle names anything but
    tensors and plain containers is refused (no opt-out here; see the error's remedies). ``mmap=True`` because
    every rank opens the file: a full load would put the whole model in each rank's memory. A legacy
    (pre-torch-1.6, non-zip) file cannot be mapped; it is refused with the remedy rather than loaded whole with a
    warning: loading it whole on every rank is exactly the memory blow-up this reader exists to prevent, and it
    would go unnoticed in a log until a larger model runs out of memory; converting it is one command.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist")
        if not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{path} is not a zip-format torch file (a legacy torch.save format from before torch 1.6, or not "
                "a torch file at all), so it cannot be memory-mapped and every rank would hold all of it. Convert "
                f"it once: `zero-to-fp32 {path} model.safetensors`, or in Python "
                "`torch.save(torch.load(OLD, weights_only=True), NEW)`, and load the new file."
            )
        try:
            content = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"{path} holds objects other than tensors and plain data, and pretrained weights are loaded with "
                "weights_only=True so that a downloaded file never runs code. If you trust the file, extract its "
                "weights once: `zero-to-fp32 --unsafe-trainer-state FILE model.safetensors` (Lightning "
                "checkpoints), or torch.save the state_dict alone, or allow the classes with "
                f"torch.serialization.add_safe_globals. torch said: {str(error).splitlines()[0]}"
            ) from error
        except Exception as error:
            raise CheckpointError(f"{path} could not be read as a torch file: {error}") from error
        self._tensors = _state_dict_of(content, path)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def read(self, key: str, start: int, count: int) -> Tensor:
        tensor = self._tensors[key]
        if tensor.is_contiguous():  # a view of the mapped storage; clone() copies only the range
            return tensor.reshape(-1)[start : start + count].clone()
        # A stored non-contiguous tensor (e.g. a saved transpose): gather the range's elements by index, which
        # touches only them; reshape(-1) would copy the whole tensor first.
        index = torch.unravel_index(torch.arange(start, start + count), tensor.shape)
        return tensor[index].reshape(-1)

    def close(self) -> None:
        self._tensors = {}  # drops the mapping


def _state_dict_of(content: Any, path: Path) -> dict[str, Tensor]:
    """The tensors of a loaded torch file: a Lightning checkpoint's ``"state_dict"`` or the mapping itself.
    Non-tensor entries (a module's extra state) are not weights and are left out."""
    if isinstance(content, dict) and isinstance(content.get("state_dict"), dict):
        content = content["state_dict"]
    if isinstance(content, dict):
        tensors = {key: value for key, value in content.items() if isinstance(key, str) and isinstance(value, Tensor)}
        if tensors:
            return tensors
    found = (
        f"a dict with keys {sorted(map(str, content))[:10]}" if isinstance(content, dict) else type(content).__name__
    )
    raise CheckpointError(
        f"{path} holds {found}, not weights: a pretrained torch file must be a state_dict (a dict of tensors) or "
        "a Lightning checkpoint (a dict with a 'state_dict')"
    )


class ShardedCheckpointStore(TensorStore):
    """This project's sharded checkpoint directory: every key of the saved module's state_dict (tied names
    each), parameters from their fp32 masters in the rank shards (a tensor-parallel checkpoint's as whole tensors),
    buffers from the trainer state."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ckpt = TensorParallelView(path) if is_tensor_parallel_directory(path) else ShardedCheckpoint(path)
        self._params: dict[str, str] = {}  # state_dict key -> canonical parameter name
        buffer_keys: list[str] = []
        self._order: list[str] = []
        for key, kind, name in self._ckpt.manifest.state_dict_keys:
            if kind == "param":
                self._params[key] = name
            else:
                buffer_keys.append(key)
            self._order.append(key)
        self._buffers = self._load_buffers() if buffer_keys else {}
        self._order = [key for key in self._order if key in self._params or key in self._buffers]

    def _load_buffers(self) -> dict[str, Tensor]:
        state_path = self._ckpt.version_dir / TRAINER_STATE_NAME
        try:
            state = torch.load(state_path, mmap=True, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as error:
            self._ckpt.close()
            raise CheckpointError(
                f"{state_path} holds the module's buffers next to objects other than plain data (hyper-parameters "
                "such as a dataclass), and pretrained weights load with weights_only=True. If you trust the "
                f"checkpoint, consolidate it once (`zero-to-fp32 --unsafe-trainer-state {self.path} "
                "model.safetensors`) and load that file."
            ) from error
        buffers = state.get(BUFFERS_KEY, {}) if isinstance(state, dict) else {}
        return {key: value for key, value in buffers.items() if isinstance(value, Tensor)}

    def keys(self) -> list[str]:
        return list(self._order)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._params:
            return tuple(self._ckpt.params[self._params[key]][1].shape)
        return tuple(self._buffers[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        if key in self._params:
            flat = self._ckpt.params[self._params[key]][0]
            return getattr(torch, flat.dtype)  # type: ignore[no-any-return]
        return self._buffers[key].dtype

    def read(self, key: str, start: int, count: int) -> Tensor:
        if key in self._params:
            return self._ckpt.read_param(self._params[key], "flat", start, count)
        return self._buffers[key].reshape(-1)[start : start + count].clone()

    def close(self) -> None:
        self._ckpt.close()
        self._buffers = {}


class IndexStore(TensorStore):
    """A sharded checkpoint described by an index JSON (Hugging Face's ``model.safetensors.index.json`` or
    ``pytorch_model.bin.index.json``): ``weight_map`` names the shard file of every tensor."""

    def __init__(self, index_path: Path) -> None:
        self.path = index_path
        weight_map = _read_weight_map(index_path)
        self._shards: dict[str, TensorStore] = {}
        self._where: dict[str, TensorStore] = {}
        held: dict[str, set[str]] = {}  # shard file -> its keys
        try:
            for key, file_name in weight_map.items():
                if file_name not in self._shards:
                    self._shards[file_name] = open_tensor_file(index_path.parent / file_name)
                    held[file_name] = set(self._shards[file_name].keys())
                shard = self._shards[file_name]
                if key not in held[file_name]:
                    raise CheckpointError(f"{index_path} puts {key!r} in {shard.path}, which has no such tensor")
                self._where[key] = shard
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._where[key].shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._where[key].dtype(key)

    def read(self, key: str, start: int, count: int) -> Tensor:
        return self._where[key].read(key, start, count)

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()


def _read_weight_map(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{index_path} is not a readable index JSON: {error}") from error
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path} has no 'weight_map' of tensor name -> shard file name")
    return weight_map


def open_tensor_file(path: Path) -> TensorStore:
    """A single weights file: by its suffix when it has a known one, otherwise by its content (torch.save writes a
    zip archive whatever the file is called)."""
    suffix = path.suffix.lower()
    if suffix == SAFETENSORS_SUFFIX:
        return SafetensorsStore(path)
    if suffix in TORCH_SUFFIXES:
        return TorchFileStore(path)
    kind = _kind_by_content(path)
    if kind == "torch":
        return TorchFileStore(path)  # a legacy (non-zip) torch file gets that store's remedy
    if kind == "safetensors":
        return SafetensorsStore(path)
    raise CheckpointError(
        f"{path} is neither a torch file (torch.save's zip archive, or its legacy pickle format) nor a safetensors "
        f"file (its first bytes: {kind}): give a weights file ({SAFETENSORS_SUFFIX}, {', '.join(TORCH_SUFFIXES)}, "
        "*.index.json, or any torch.save output whatever its name)."
    )


def _kind_by_content(path: Path) -> str:
    """"torch" or "safetensors" from the file's first bytes; otherwise those bytes, for the error."""
    with open(path, "rb") as handle:
        head = handle.read(16)
    if zipfile.is_zipfile(path) or head[:1] == b"\x80":  # torch.save's zip archive, or a pickle (legacy torch)
        return "torch"
    # safetensors: an 8-byte little-endian header length, then the JSON header
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < path.stat().st_size:
        return "safetensors"
    return repr(head)
