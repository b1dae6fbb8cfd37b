"""Counting the bytes a rank really holds by walking tensor storages (each storage counted once)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn


def host_shared_storages(engine: Any) -> dict[int, int]:
    """Storages the ranks of one host share, by data pointer, with how many ranks share each: stage 3 on one host's
    CPU keeps each FlatParam's parameter buffer once per host in shared memory."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    flats = engine.flat_params if engine is not None else []
    return {flat.full.untyped_storage().data_ptr(): world for flat in flats if flat.storage.full.readable_in_place}


def private_storage_bytes(tensors: Iterable[Tensor], engine: Any) -> int:
    """Bytes of the storages behind ``tensors`` that are this process's alone (host-shared buffers left out)."""
    shared = host_shared_storages(engine)
    return sum(t.untyped_storage().nbytes() for t in tensors if t.untyped_storage().data_ptr() not in shared)


def mapped_pages(tensor: Tensor) -> tuple[int, int]:
    """(pages of ``tensor`` mapped into this process, pages it spans), from /proc/self/pagemap's "present" bit."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    count = -(-(end - start) // page)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start // page * 8)
        entries = pagemap.read(count * 8)
    return sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8)), count


class StorageTally:
    """Sums ``untyped_storage().nbytes()`` over distinct storages; one tally shared across categories means a
    storage already counted as "parameters" is not counted again as "gradients". A storage in ``shared`` (data
    pointer → ranks sharing it, see :func:`host_shared_storages`) is one copy per host: each rank is charged its
    share."""

    def __init__(self, shared: Mapping[int, int] | None = None) -> None:
        self._seen: list[torch.UntypedStorage] = []  # keep them alive so ids/pointers are not reused
        self._shared = shared or {}

    def _is_new(self, storage: torch.UntypedStorage) -> bool:
        for other in self._seen:
            if other is storage or (storage.nbytes() > 0 and other.data_ptr() == storage.data_ptr()):
                return False
        self._seen.append(storage)
        return True

    def bytes_of(self, tensors: Iterable[Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if self._is_new(storage):
                total += storage.nbytes() // self._shared.get(storage.data_ptr(), 1)
        return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, min_numel: int = 0) -> list[Tensor]:
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor) and value.numel() >= min_numel
    ]


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """What the optimizer steps (under ZeRO: the master pieces)."""
    return [p for group in optimizer.param_groups for p in group["params"]]
