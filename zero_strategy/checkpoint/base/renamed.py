"""A checkpoint read under other parameter names: what a Lightning ``on_load_checkpoint`` hook asked for when it
renamed or dropped keys of the state dict it was given (see [Note: the state dict in Lightning's hooks] in
lightning/hook_state_dict.py). Loading (checkpoint/sharded/load.py) reads it like the checkpoint itself."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from zero_strategy.checkpoint.base.format import FlatEntry, ParamEntry
from zero_strategy.checkpoint.base.source import ReadableCheckpoint


class RenamedCheckpoint:
    """``checkpoint`` whose parameter ``source`` is read as ``name`` for every ``name: source`` of ``names``; a
    parameter no name maps to is absent."""

    def __init__(self, checkpoint: ReadableCheckpoint, names: Mapping[str, str]) -> None:
        self._checkpoint = checkpoint
        self._source = dict(names)
        self.path: Path = checkpoint.path
        self.params: dict[str, tuple[FlatEntry, ParamEntry]] = {
            name: checkpoint.params[source] for name, source in names.items() if source in checkpoint.params
        }

    @property
    def sources(self) -> dict[str, str]:
        """Each name read → the checkpoint's name for it."""
        return dict(self._source)

    def __getattr__(self, attribute: str) -> Any:
        """Everything that is not per parameter (the manifest, the trainer state) is the checkpoint's own."""
        return getattr(self._checkpoint, attribute)

    def read_param(
        self, name: str, tensor_of: str = "flat", start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:  # fmt: skip
        return self._checkpoint.read_param(self._source[name], tensor_of, start, count, optimizer)

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        return self._checkpoint.state_names(flat, optimizer)

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        return self._checkpoint.scalar_state_at(flat, position, optimizer)

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        return self._checkpoint.rng_state(rank)
