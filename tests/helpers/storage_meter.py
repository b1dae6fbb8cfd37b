"""Measuring how many bytes of tensor storage code holds at once, from the outside: every aten op is watched.

``StoragePeakMeter`` is a ``TorchDispatchMode``: each op's outputs whose storage is new (not one of the op's inputs,
as an in-place op's or a view's is) are remembered through a weak reference, and after every op the bytes of the
remembered storages still alive are summed; the largest sum is the peak. It counts what torch really allocated
while the meter was on, whoever asked for it, and nothing the code under test reports about itself. Storages that
existed before (parameters, buffers allocated earlier) are not counted; meta tensors have no bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(values: Any) -> list[torch.UntypedStorage]:
    leaves, _ = tree_flatten(values)
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf.untyped_storage())
        elif isinstance(leaf, torch.UntypedStorage):  # set_() takes a storage
            found.append(leaf)
        elif isinstance(leaf, torch.TypedStorage):
            found.append(leaf.untyped_storage)
    return found


class StoragePeakMeter(TorchDispatchMode):
    """``with StoragePeakMeter() as meter: ...`` then ``meter.peak_bytes`` (and ``meter.live_bytes()`` now)."""

    def __init__(self) -> None:
        super().__init__()
        self._tracked: dict[int, tuple[StorageWeakRef, int]] = {}  # data pointer -> (weak ref, bytes)
        self.peak_bytes = 0

    def live_bytes(self) -> int:
        """Bytes of the storages created under the meter that are still alive."""
        for pointer in [p for p, (ref, _) in self._tracked.items() if ref.expired()]:
            del self._tracked[pointer]
        return sum(nbytes for _, nbytes in self._tracked.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage.data_ptr() for storage in _storages((args, kwargs))}
        for storage in _storages(out):
            pointer = storage.data_ptr()
            if storage.device.type == "meta" or storage.nbytes() == 0 or pointer in inputs:
                continue
            known = self._tracked.get(pointer)
            if known is None or known[0].expired():  # a new storage (or a freed address given out again)
                self._tracked[pointer] = (StorageWeakRef(storage), storage.nbytes())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out
