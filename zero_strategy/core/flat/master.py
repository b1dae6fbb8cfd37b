"""The master pieces: this rank's slice of a FlatParam cut at optimizer param-group boundaries, as the
``nn.Parameter`` objects the user's optimizer steps instead of the module's parameters."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor, nn

from zero_strategy.core.plan.layout import FlatLayout, group_ranges


@dataclass(slots=True)
class MasterPieces:
    """``pieces[i]`` is ``shard[offsets[i] : offsets[i] + numel]`` and belongs to param group ``group_index[i]``."""

    pieces: list[nn.Parameter]
    group_index: list[int]
    offsets: list[int]

    @classmethod
    def carve(
        cls, layout: FlatLayout, params: list[nn.Parameter], group_index_of: dict[int, int] | None, shard: Tensor,
        rank: int,
    ) -> MasterPieces:
        """Split ``shard`` (``rank``'s slice) at param-group boundaries (the parameters were sorted by group);
        nothing for parameters no optimizer steps."""
        if group_index_of is None:
            return cls([], [], [])
        carved = cls([], [], [])
        start, end = layout.shard_range(rank)
        for group_index, (lo, hi) in group_ranges(layout, params, group_index_of):
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                carved.pieces.append(nn.Parameter(shard[lo - start : hi - start], requires_grad=True))
                carved.group_index.append(group_index)
                carved.offsets.append(lo - start)
        return carved

    def __iter__(self) -> Iterator[tuple[nn.Parameter, int]]:
        """(piece, its offset in the shard)."""
        return zip(self.pieces, self.offsets, strict=True)

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def repoint(self, shard: Tensor) -> None:
        """The shard moved to new memory (its own, after release): make each piece a view of it again (the
        optimizer keeps the same parameter objects and their state)."""
        for piece, offset in self:
            piece.data = shard[offset : offset + piece.numel()]
