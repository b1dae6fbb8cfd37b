"""Streaming safetensors: write tensors one at a time, read any element range of one tensor without loading more.

The library's ``save_file`` serializes everything into one bytes object first, and its readers map whole files;
both would make memory grow with the model. The format is simple enough to stream (an 8-byte little-endian header
length, a JSON header of dtype/shape/byte offsets, then raw little-endian data), and files written here are
ordinary safetensors files that ``safetensors.safe_open`` reads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import CheckpointError

READ_CHUNK_BYTES = 2**20
"""Largest piece of a tensor read from a file at once, by consolidation and pretrained loading (see [Note:
streaming consolidation] in checkpoint/export/consolidate.py)."""

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def _raw_bytes(tensor: Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # numpy has no bfloat16: reinterpret any dtype as bytes of the same width.
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


def write_safetensors(
    path: Path,
    named_specs: list[tuple[str, torch.dtype, list[int]]],
    tensors: Iterable[Tensor],
    metadata: dict[str, str],
) -> int:
    """Write tensors in the order of ``named_specs`` (name, dtype, shape), pulling them one at a time from
    ``tensors``; fsync and return the file size."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in named_specs:
        numel = 1
        for dim in shape:
            numel *= dim
        size = numel * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        # Pulled with next() and dropped after writing, not zipped: zip's reused result tuple (and a loop variable)
        # would keep the previous tensor alive while the next one is produced, two tensors in memory instead of one
        # (see [Note: streaming consolidation] in checkpoint/export/consolidate.py).
        pending = iter(tensors)
        for name, dtype, shape in named_specs:
            tensor = next(pending, None)
            if tensor is None:
                raise ValueError(f"tensor {name}: the tensors ran out before the names did")
            if tensor.dtype != dtype or list(tensor.shape) != shape:
                raise ValueError(f"tensor {name}: expected {dtype} {shape}, got {tensor.dtype} {list(tensor.shape)}")
            handle.write(_raw_bytes(tensor))
            del tensor
        if next(pending, None) is not None:
            raise ValueError(f"more tensors than the {len(named_specs)} names")
        handle.flush()
        os.fsync(handle.fileno())
    return path.stat().st_size


class SafetensorsReader:
    """Reads element ranges of tensors from a safetensors file, validating its size against its header."""

    def __init__(self, path: Path, expected_bytes: int | None = None) -> None:
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if expected_bytes is not None and size != expected_bytes:
            raise CheckpointError(
                f"{path} is {size} bytes but the manifest recorded {expected_bytes}: truncated or replaced"
            )
        self._handle: BinaryIO = open(path, "rb")  # kept open for ranged reads; close()
        try:
            (header_len,) = struct.unpack("<Q", self._handle.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(self._handle.read(header_len))
        except (struct.error, ValueError) as error:
            self._handle.close()
            raise CheckpointError(f"{path} is not a valid safetensors file ({error})") from error
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self.entries: dict[str, dict] = header
        self._data_start = 8 + header_len
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if self._data_start + end > size:
            self._handle.close()
            raise CheckpointError(
                f"{path} is truncated: its header describes {self._data_start + end} bytes, the file has {size}"
            )

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handle.close()

    def names(self) -> Iterator[str]:
        return iter(self.entries)

    def numel(self, name: str) -> int:
        numel = 1
        for dim in self.entries[name]["shape"]:
            numel *= dim
        return numel

    def entries_dtype(self, name: str) -> torch.dtype:
        return CODE_DTYPES[self.entries[name]["dtype"]]

    def read(self, name: str, start: int = 0, count: int | None = None) -> Tensor:
        """Elements ``[start, start + count)`` of the flattened tensor ``name`` (a new 1-D CPU tensor)."""
        if name not in self.entries:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        entry = self.entries[name]
        dtype = CODE_DTYPES[entry["dtype"]]
        count = self.numel(name) - start if count is None else count
        out = torch.empty(count, dtype=dtype)
        width = out.element_size()
        self._handle.seek(self._data_start + entry["data_offsets"][0] + start * width)
        if count:
            got = self._handle.readinto(memoryview(out.view(torch.uint8).numpy()))  # type: ignore[attr-defined,arg-type]
            if got != count * width:
                raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        return out
