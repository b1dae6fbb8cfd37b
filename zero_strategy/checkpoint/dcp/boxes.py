"""A flat element range of an N-D tensor, cut into the boxes ``torch.distributed.checkpoint`` (DCP) describes
tensors with. Pure integer arithmetic: no tensors, no files.

[Note: a flat range is at most 2·(ndim−1)+1 boxes]
A rank's slice of a FlatParam covers elements ``[start, start + count)`` of a parameter's row-major flattening. DCP
stores a tensor as chunks, each a box (an offset and a size per dimension), and reshards by intersecting boxes. A
flat range of a matrix is not one box but at most three: the tail of its first row, a block of whole rows, the head
of its last row. For N dimensions the same cut applies to the outermost one, and the partial first and last
slices are themselves ranges of an (N−1)-D tensor, cut recursively: a range that ends at a slice's end needs at
most one box per dimension (a suffix), one that starts at a slice's start likewise (a prefix), so a range is at
most ``(ndim − 1) + 1 + (ndim − 1)`` boxes. Every box is a *contiguous* run of the range in row-major order, so its
values are ``flat_values[box.range_start : box.range_start + box.numel].view(box.sizes)`` — no gather, no copy
beyond the run itself. A 0-d tensor (a scalar) is one box of no dimensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Box:
    """One box of a flat range: where it sits in the tensor, and where its values sit in the range."""

    offsets: tuple[int, ...]  # first index along each dimension
    sizes: tuple[int, ...]  # extent along each dimension
    range_start: int  # first element of the box, counted from the range's start (the box is contiguous there)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def max_boxes(ndim: int) -> int:
    """The most boxes a flat range of an ``ndim``-D tensor can need (see [Note: a flat range is at most 2·(ndim−1)+1
    boxes])."""
    return 1 if ndim == 0 else 2 * (ndim - 1) + 1


def range_boxes(shape: tuple[int, ...] | list[int], start: int, count: int) -> list[Box]:
    """The boxes that exactly tile elements ``[start, start + count)`` of a tensor of ``shape``, in row-major order.

    Raises ``ValueError`` for a range outside the tensor. An empty range has no boxes."""
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if start < 0 or count < 0 or start + count > numel:
        raise ValueError(f"elements [{start}, {start + count}) are outside a tensor of shape {list(shape)} ({numel})")
    boxes: list[Box] = []
    position = 0  # running offset inside the range: boxes come out in row-major order, each right after the last
    for offsets, sizes in _cut(shape, start, start + count):
        boxes.append(Box(offsets, sizes, position))
        position += math.prod(sizes)
    return boxes


def _cut(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes of ``[start, end)`` (element indices of the flattening), in row-major order."""
    if start >= end:
        return []
    if not shape:  # a scalar: the only range that is not empty is the whole of it
        return [((), ())]
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)  # elements of one slice along dimension 0
    first, first_at = divmod(start, inner)
    last, last_at = divmod(end, inner)  # ``end`` is exclusive: slice ``last`` holds ``last_at`` of its elements
    whole = (0,) * len(inner_shape)
    if first == last:  # the range lies inside one slice: cut that slice
        return _in_slice(first, _cut(inner_shape, first_at, last_at))
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if first_at > 0:  # the partial first slice (its suffix)
        boxes += _in_slice(first, _cut(inner_shape, first_at, inner))
        first += 1
    if last > first:  # whole slices: one box
        boxes.append(((first, *whole), (last - first, *inner_shape)))
    if last_at > 0:  # the partial last slice (its prefix)
        boxes += _in_slice(last, _cut(inner_shape, 0, last_at))
    return boxes


def _in_slice(index: int, inner: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list:
    """Boxes of one slice along dimension 0, as boxes of the whole tensor."""
    return [((index, *offsets), (1, *sizes)) for offsets, sizes in inner]
