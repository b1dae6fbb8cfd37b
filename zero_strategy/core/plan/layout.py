"""Flat-buffer arithmetic: where each parameter sits in a padded flat buffer and which slice each rank owns.

Pure integer arithmetic, no tensors and no communication, so it can be unit-tested for any world size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class ParamSpan:
    """One parameter's place in a flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int  # first element in the flat (unpadded) buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, slots=True)
class SliceOverlap:
    """The part of one parameter that falls inside one rank's shard."""

    name: str
    param_start: int  # first element, counted inside the flattened parameter
    shard_start: int  # where that element sits inside the rank's shard
    numel: int


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Parameters laid end to end, padded so the buffer splits evenly into ``world_size`` shards."""

    spans: tuple[ParamSpan, ...]
    world_size: int

    @staticmethod
    def build(named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> FlatLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        spans: list[ParamSpan] = []
        offset = 0
        for name, shape in named_shapes:
            numel = 1
            for dim in shape:
                numel *= dim
            spans.append(ParamSpan(name=name, shape=tuple(shape), offset=offset, numel=numel))
            offset += numel
        return FlatLayout(spans=tuple(spans), world_size=world_size)

    @property
    def numel(self) -> int:
        """Elements of real data (no padding)."""
        return self.spans[-1].end if self.spans else 0

    @property
    def shard_numel(self) -> int:
        """Elements in each rank's shard (the last rank's shard ends in padding)."""
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded flat buffer."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def valid_numel(self, rank: int) -> int:
        """Elements of ``rank``'s shard that hold real data, not padding."""
        start, end = self.shard_range(rank)
        return max(0, min(end, self.numel) - start)

    def overlaps(self, rank: int) -> list[SliceOverlap]:
        """The pieces of parameters stored in ``rank``'s shard, in flat order."""
        start, end = self.shard_range(rank)
        pieces: list[SliceOverlap] = []
        for span in self.spans:
            lo, hi = max(start, span.offset), min(end, span.end)
            if lo < hi:
                pieces.append(
                    SliceOverlap(name=span.name, param_start=lo - span.offset, shard_start=lo - start, numel=hi - lo)
                )
        return pieces


def group_ranges(
    layout: FlatLayout, params: Sequence[nn.Parameter], groups_of: Mapping[int, tuple[int, ...]]
) -> list[tuple[tuple[int, ...], tuple[int, int]]]:
    """(param groups, (start, end)) ranges of ``layout``'s flat buffer, one per combination of param groups (a
    parameter's group in each optimizer that steps it): the parameters were sorted by it, so each combination's
    parameters are contiguous (checked)."""
    ranges: list[tuple[tuple[int, ...], tuple[int, int]]] = []
    for span, param in zip(layout.spans, params, strict=True):
        groups = groups_of[id(param)]
        if ranges and ranges[-1][0] == groups and ranges[-1][1][1] == span.offset:
            ranges[-1] = (groups, (ranges[-1][1][0], span.end))
        else:
            ranges.append((groups, (span.offset, span.end)))
    seen = [groups for groups, _ in ranges]
    if len(seen) != len(set(seen)):
        raise AssertionError("parameters of one combination of param groups must be contiguous in a FlatParam")
    return ranges
