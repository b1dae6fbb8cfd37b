"""What loading into an engine asks of a checkpoint, whatever its format: our own sharded directory
(``ShardedCheckpoint``) or a ``torch.distributed.checkpoint`` directory (``DcpCheckpoint``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from zero_strategy.checkpoint.base.format import FlatEntry, ParamEntry


class ReadableCheckpoint(Protocol):
    """Parameters by name and element range, their optimizer state, and each rank's RNG state."""

    path: Path
    params: dict[str, tuple[FlatEntry, ParamEntry]]  # canonical parameter name -> where it sits

    def read_param(
        self, name: str, tensor_of: str = "flat", start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        """Elements ``[start, start + count)`` of parameter ``name``'s weights (``"flat"``) or of one optimizer
        state (``"optim:<state name>"``) of optimizer ``optimizer`` (None: the parameter's only, or first,
        optimizer), as a new 1-D CPU tensor."""
        ...

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        """Per-element state names optimizer ``optimizer`` stored for the parameters of ``flat``."""
        ...

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        """Scalar state (``step``) optimizer ``optimizer`` keeps for the piece holding flat element ``position``,
        as records that ``shard_content.scalar_value`` turns into values."""
        ...

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        """Rank ``rank``'s RNG state, or None when the checkpoint has none for it."""
        ...
