"""Pretrained weights from a DeepSpeed ZeRO checkpoint directory (``pretrained=DEEPSPEED_DIR``): the module's
state-dict keys (checkpoint/deepspeed/state_dict.py), each element range read from the rank partitions it
overlaps only (the files are memory-mapped)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from zero_strategy.checkpoint.deepspeed.state_dict import Key, read_key, state_dict_keys
from zero_strategy.checkpoint.deepspeed.universal import open_deepspeed
from zero_strategy.checkpoint.pretrained.stores import TensorStore


class DeepSpeedStore(TensorStore):
    """A DeepSpeed checkpoint's parameters (fp32 master weights) and buffers, by state-dict key."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ckpt = open_deepspeed(path)
        self._keys: dict[str, Key] = {key.key: key for key in state_dict_keys(self._ckpt)}

    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._keys[key].shape

    def dtype(self, key: str) -> torch.dtype:
        entry = self._keys[key]
        return torch.float32 if entry.param is not None else self._ckpt.buffers()[key].dtype

    def read(self, key: str, start: int, count: int) -> Tensor:
        return read_key(self._ckpt, self._keys[key], start, count)

    def close(self) -> None:
        self._ckpt.close()
