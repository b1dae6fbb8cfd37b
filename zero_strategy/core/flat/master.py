"""The master pieces: this rank's slice of a FlatParam cut wherever a parameter's param group changes in any
optimizer that steps it, as the ``nn.Parameter`` objects the user's optimizers step instead of the module's
parameters. Several optimizers stepping one FlatParam list the same piece objects in their param groups; each
keeps its own state for them (torch keys an optimizer's state by the parameter object, per optimizer)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor, nn

from zero_strategy.core.plan.layout import FlatLayout, group_ranges


@dataclass(slots=True)
class MasterPieces:
    """``pieces[i]`` is ``shard[offsets[i] : offsets[i] + numel]``; ``groups[i]`` is its param group in each
    optimizer that steps the FlatParam (parallel to ``FlatSpec.optimizers``)."""

    pieces: list[nn.Parameter]
    groups: list[tuple[int, ...]]
    offsets: list[int]

    @classmethod
    def carve(
        cls, layout: FlatLayout, params: list[nn.Parameter], groups_of: dict[int, tuple[int, ...]], shard: Tensor,
        rank: int,
    ) -> MasterPieces:
        """Split ``shard`` (``rank``'s slice) wherever the parameters' param groups change (they were sorted by
        them); nothing for parameters no optimizer steps (``groups_of`` empty)."""
        carved = cls([], [], [])
        if not groups_of:
            return carved
        start, end = layout.shard_range(rank)
        for groups, (lo, hi) in group_ranges(layout, params, groups_of):
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                carved.pieces.append(nn.Parameter(shard[lo - start : hi - start], requires_grad=True))
                carved.groups.append(groups)
                carved.offsets.append(lo - start)
        return carved

    def __iter__(self) -> Iterator[tuple[nn.Parameter, int]]:
        """(piece, its offset in the shard)."""
        return zip(self.pieces, self.offsets, strict=True)

    def __bool__(self) -> bool:
        return bool(self.pieces)

    def repoint(self, shard: Tensor) -> None:
        """The shard moved to new memory (its own, after release): make each piece a view of it again (the
        optimizers keep the same parameter objects and their state)."""
        for piece, offset in self:
            piece.data = shard[offset : offset + piece.numel()]
