"""Where each element of a trainable parameter sits in DeepSpeed's per-rank fp32 partitions.

[Note: DeepSpeed's partitions]
Stages 1 and 2 flatten each param group's trainable parameters in ``param_shapes`` order into one vector (a
parameter may be followed by alignment padding, ``param_alignment_paddings``; the vector is padded at its end to
a multiple of the world size, ``group_paddings``), and rank ``r`` keeps elements ``[r * P, (r + 1) * P)`` of it,
``P`` the length of every rank's ``single_partition_of_fp32_groups[g]``. Stage 3 partitions each parameter on its
own: a parameter of ``n`` elements is padded to ``ceil(n / W) * W`` and rank ``r`` keeps its ``r``-th piece of
``ceil(n / W)``; a rank's ``fp32_flat_groups`` are its pieces of every parameter, in ``param_shapes`` order across
all groups, cut into sub-groups. The optimizer's per-element state of a group or sub-group lies exactly over the
fp32 vector of the same index, so one map serves the weights and every state. (DeepSpeed's zero_to_fp32 reads them
the same way; the fixtures hold us to its output.)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from zero_strategy.checkpoint.base.format import CheckpointError


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` elements of a parameter at ``offset`` of rank ``rank``'s vector number ``vector``."""

    rank: int
    vector: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Placed:
    """A trainable parameter: its param group, its first element's place (stage 1/2: in the group's whole flat
    vector; stage 3: in a rank's concatenated vectors) and its size."""

    group: int
    start: int
    numel: int


class PartitionMap:
    """Element ranges of trainable parameters as segments of per-rank vectors (see [Note: DeepSpeed's partitions])."""

    def __init__(
        self,
        stage: int,
        world_size: int,
        shapes: list[dict[str, int]],  # per param group: name -> numel, in DeepSpeed's order
        vector_sizes: list[int],  # numel of each per-rank vector (every rank's are equal)
        alignment: list[list[int]] | None,  # padding after each parameter, per group (stages 1/2), if recorded
    ) -> None:
        self.stage = stage
        self.world_size = world_size
        self.placed: dict[str, Placed] = {}
        self._vector_sizes = vector_sizes
        self._vector_starts = [0]
        for size in vector_sizes:
            self._vector_starts.append(self._vector_starts[-1] + size)
        if stage <= 2:
            self._place_flat_groups(shapes, alignment)
        else:
            self._place_per_parameter(shapes)

    def _place_flat_groups(self, shapes: list[dict[str, int]], alignment: list[list[int]] | None) -> None:
        if len(shapes) != len(self._vector_sizes):
            raise CheckpointError(f"{len(shapes)} param groups but {len(self._vector_sizes)} fp32 partitions")
        for group, names in enumerate(shapes):
            offset = 0
            for index, (name, numel) in enumerate(names.items()):
                self.placed[name] = Placed(group, offset, numel)
                offset += numel + (alignment[group][index] if alignment is not None else 0)
            if offset > self._vector_sizes[group] * self.world_size:
                raise CheckpointError(
                    f"param group {group} needs {offset} elements but its partitions hold "
                    f"{self._vector_sizes[group]} x {self.world_size}"
                )

    def _place_per_parameter(self, shapes: list[dict[str, int]]) -> None:
        offset = 0
        for group, names in enumerate(shapes):
            for name, numel in names.items():
                self.placed[name] = Placed(group, offset, numel)
                offset += math.ceil(numel / self.world_size)
        if offset != self._vector_starts[-1]:
            raise CheckpointError(
                f"the parameters need {offset} elements per rank but each rank's fp32 groups hold "
                f"{self._vector_starts[-1]}"
            )

    def segments(self, name: str, start: int, count: int) -> list[Segment]:
        """Elements ``[start, start + count)`` of parameter ``name`` as segments, in order."""
        placed = self.placed[name]
        if start < 0 or start + count > placed.numel:
            raise CheckpointError(f"elements [{start}, {start + count}) are outside {name} ({placed.numel})")
        if self.stage <= 2:
            size = self._vector_sizes[placed.group]
            return _split(placed.start + start, count, size, lambda rank, at, n: Segment(rank, placed.group, at, n))
        piece = math.ceil(placed.numel / self.world_size)
        segments: list[Segment] = []
        for seg in _split(start, count, piece, lambda rank, at, n: Segment(rank, 0, at, n)):
            segments += self._in_vectors(seg.rank, placed.start + seg.offset, seg.length)
        return segments

    def _in_vectors(self, rank: int, at: int, count: int) -> list[Segment]:
        """A run of a rank's concatenated vectors as segments of the vectors themselves."""
        out = []
        while count > 0:
            vector = bisect.bisect_right(self._vector_starts, at) - 1
            inside = at - self._vector_starts[vector]
            length = min(count, self._vector_sizes[vector] - inside)
            out.append(Segment(rank, vector, inside, length))
            at, count = at + length, count - length
        return out


def _split(first: int, count: int, size: int, make: object) -> list[Segment]:
    """Cut the run ``[first, first + count)`` of a vector dealt out in pieces of ``size`` per rank."""
    out = []
    while count > 0:
        rank, inside = divmod(first, size)
        length = min(count, size - inside)
        out.append(make(rank, inside, length))  # type: ignore[operator]
        first, count = first + length, count - length
    return out
