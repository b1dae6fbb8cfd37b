"""The boxes of a flat element range (zero_strategy/checkpoint/dcp/boxes.py): for every range of tensors of 0 to 4
dimensions they tile exactly that range, each box is a contiguous run of it in row-major order, and there are at
most 2·(ndim−1)+1 of them. Reference: torch's own indexing of ``arange(numel).view(shape)``."""

from __future__ import annotations

import math

import pytest
import torch

from zero_strategy.checkpoint.dcp.boxes import max_boxes, range_boxes

SHAPES = [(), (1,), (7,), (3, 5), (1, 6), (4, 1), (2, 3, 4), (3, 1, 5), (2, 3, 2, 3), (5, 0), (0,)]


def _all_ranges(numel: int) -> list[tuple[int, int]]:
    return [(start, count) for start in range(numel + 1) for count in range(numel - start + 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_tile_every_range_in_row_major_order(shape):
    numel = math.prod(shape)
    values = torch.arange(numel).view(shape)
    for start, count in _all_ranges(numel):
        boxes = range_boxes(shape, start, count)
        assert len(boxes) <= max_boxes(len(shape)), (shape, start, count, boxes)
        assert sum(box.numel for box in boxes) == count
        position = 0
        for box in boxes:
            assert box.range_start == position, "boxes must come in row-major order, each right after the last"
            region = values[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]
            assert tuple(region.shape) == box.sizes
            expected = torch.arange(start + box.range_start, start + box.range_start + box.numel)
            assert torch.equal(region.reshape(-1), expected), (shape, start, count, box)
            position += box.numel


def test_the_bound_is_reached():
    """A range from inside a row of plane 1 to inside a row of plane 3 of a 3-D tensor needs all five boxes: the
    tail of a row, the rest of its plane, the whole plane between, the head of a plane, the head of a row."""
    shape = (4, 3, 5)
    start, end = 1 * 15 + 1 * 5 + 2, 3 * 15 + 1 * 5 + 3
    boxes = range_boxes(shape, start, end - start)
    assert len(boxes) == max_boxes(3) == 5
    assert [(b.offsets, b.sizes) for b in boxes] == [
        ((1, 1, 2), (1, 1, 3)),
        ((1, 2, 0), (1, 1, 5)),
        ((2, 0, 0), (1, 3, 5)),
        ((3, 0, 0), (1, 1, 5)),
        ((3, 1, 0), (1, 1, 3)),
    ]


def test_a_whole_tensor_is_one_box_and_whole_rows_stay_together():
    assert [(b.offsets, b.sizes) for b in range_boxes((6, 4), 0, 24)] == [((0, 0), (6, 4))]
    assert [(b.offsets, b.sizes) for b in range_boxes((6, 4), 4, 12)] == [((1, 0), (3, 4))]
    assert [(b.offsets, b.sizes) for b in range_boxes((6, 4), 5, 12)] == [
        ((1, 1), (1, 3)),
        ((2, 0), (2, 4)),
        ((4, 0), (1, 1)),
    ]


@pytest.mark.parametrize(("start", "count"), [(-1, 2), (0, 13), (12, 1), (5, -1)])
def test_a_range_outside_the_tensor_is_refused(start, count):
    with pytest.raises(ValueError, match=r"outside a tensor of shape \[3, 4\]"):
        range_boxes((3, 4), start, count)


def test_random_ranges_of_larger_tensors():
    g = torch.Generator().manual_seed(0)
    for shape in [(17, 23), (5, 7, 11), (3, 4, 5, 6)]:
        numel = math.prod(shape)
        values = torch.arange(numel).view(shape)
        for _ in range(200):
            start = int(torch.randint(0, numel + 1, (), generator=g))
            count = int(torch.randint(0, numel - start + 1, (), generator=g))
            boxes = range_boxes(shape, start, count)
            assert len(boxes) <= max_boxes(len(shape))
            pieces = [
                values[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))].reshape(-1)
                for b in boxes
            ]
            got = torch.cat(pieces) if pieces else torch.empty(0, dtype=values.dtype)
            assert torch.equal(got, torch.arange(start, start + count))


def test_max_boxes():
    assert [max_boxes(n) for n in range(5)] == [1, 1, 3, 5, 7]
