"""Counting the bytes a rank really holds by walking tensor storages (each storage counted once)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn


class StorageTally:
    """Sums ``untyped_storage().nbytes()`` over distinct storages; one tally shared across categories means a
    storage already counted as "parameters" is not counted again as "gradients"."""

    def __init__(self) -> None:
        self._seen: list[torch.UntypedStorage] = []  # keep them alive so ids/pointers are not reused

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
                total += storage.nbytes()
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
