"""Pretrained weights from a ``torch.distributed.checkpoint`` directory (FSDP2, torchtitan, Lightning's
FSDPStrategy / ModelParallelStrategy, or our own DCP checkpoints): the model's tensors under their state_dict keys
(see [Note: reading other tools' DCP layouts] in checkpoint/dcp/keys.py), each element range read from the stored chunks
it overlaps only."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from zero_strategy.checkpoint.dcp.reader import DcpCheckpoint
from zero_strategy.checkpoint.pretrained.stores import TensorStore


class DcpStore(TensorStore):
    """A DCP checkpoint's model tensors, by their key in the module's state_dict (the layout's prefix removed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ckpt = DcpCheckpoint(path)

    def keys(self) -> list[str]:
        return list(self._ckpt.keys.model)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._ckpt.params[key][1].shape)

    def dtype(self, key: str) -> torch.dtype:
        dtype = getattr(torch, self._ckpt.params[key][0].dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    def read(self, key: str, start: int, count: int) -> Tensor:
        return self._ckpt.read_tensor(self._ckpt.keys.model[key], start, count)

    def close(self) -> None:
        self._ckpt.close()
