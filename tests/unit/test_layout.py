"""FlatLayout arithmetic: padding, shard ranges and per-rank overlaps, checked against brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from zero_strategy.core.plan.layout import FlatLayout, SliceOverlap

SHAPE_SETS = {
    "one_scalar": [("s", ())],
    "mixed": [("w", (4, 3)), ("b", (3,)), ("g", (2, 2, 2)), ("s", ())],
    "uneven": [("a", (7,)), ("b", (5, 1)), ("c", (1,))],
    "with_empty": [("a", (3,)), ("empty", (0, 4)), ("b", (2,))],
    "big_first": [("w", (10, 10)), ("b", (1,))],
}


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shapes", list(SHAPE_SETS), ids=list(SHAPE_SETS))
def test_layout_arithmetic(shapes, world_size):
    named = SHAPE_SETS[shapes]
    layout = FlatLayout.build(named, world_size)
    total = sum(_numel(shape) for _, shape in named)

    # spans: end to end, in order, shapes kept
    offset = 0
    assert [s.name for s in layout.spans] == [n for n, _ in named]
    for span, (_, shape) in zip(layout.spans, named, strict=True):
        assert span.shape == tuple(shape)
        assert span.offset == offset
        assert span.numel == _numel(shape)
        assert span.end == offset + _numel(shape)
        offset += _numel(shape)

    # padding: the smallest multiple of world_size that holds the data
    assert layout.numel == total
    assert layout.shard_numel == -(-total // world_size)
    assert layout.padded_numel == layout.shard_numel * world_size
    assert total <= layout.padded_numel < total + world_size

    # shards tile the padded buffer
    ranges = [layout.shard_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end == start
    assert all(end - start == layout.shard_numel for start, end in ranges)
    assert sum(layout.valid_numel(r) for r in range(world_size)) == total
    for r, (start, end) in enumerate(ranges):
        assert layout.valid_numel(r) == len([i for i in range(start, end) if i < total])

    # overlaps cover every element of every parameter exactly once, at the right flat position
    covered = {name: [0] * _numel(shape) for name, shape in named}
    span_of = {s.name: s for s in layout.spans}
    for r in range(world_size):
        start, end = layout.shard_range(r)
        previous_end = -1
        for piece in layout.overlaps(r):
            assert isinstance(piece, SliceOverlap)
            assert piece.numel > 0
            assert 0 <= piece.shard_start and piece.shard_start + piece.numel <= layout.shard_numel
            assert piece.shard_start >= previous_end  # flat order, no overlap inside the shard
            previous_end = piece.shard_start + piece.numel
            span = span_of[piece.name]
            assert start + piece.shard_start == span.offset + piece.param_start
            for i in range(piece.param_start, piece.param_start + piece.numel):
                covered[piece.name][i] += 1
        assert sum(p.numel for p in layout.overlaps(r)) == layout.valid_numel(r)
    for name, counts in covered.items():
        assert all(c == 1 for c in counts), f"{name}: coverage {counts}"


@pytest.mark.timeout(10)
def test_layout_hand_example():
    layout = FlatLayout.build([("a", (3,)), ("b", (2, 2))], 3)  # 7 elements → 3 shards of 3, 2 padding
    assert (layout.numel, layout.shard_numel, layout.padded_numel) == (7, 3, 9)
    assert [layout.shard_range(r) for r in range(3)] == [(0, 3), (3, 6), (6, 9)]
    assert [layout.valid_numel(r) for r in range(3)] == [3, 3, 1]
    assert layout.overlaps(0) == [SliceOverlap("a", 0, 0, 3)]
    assert layout.overlaps(1) == [SliceOverlap("b", 0, 0, 3)]
    assert layout.overlaps(2) == [SliceOverlap("b", 3, 0, 1)]

    layout = FlatLayout.build([("a", (5,)), ("b", (4,))], 2)  # 9 → 2 × 5; a parameter split across ranks
    assert layout.overlaps(0) == [SliceOverlap("a", 0, 0, 5)]
    assert layout.overlaps(1) == [SliceOverlap("b", 0, 0, 4)]
    assert layout.valid_numel(1) == 4

    layout = FlatLayout.build([("a", (2,)), ("b", (3,))], 2)  # 5 → 2 × 3: "b" straddles the boundary
    assert layout.overlaps(0) == [SliceOverlap("a", 0, 0, 2), SliceOverlap("b", 0, 2, 1)]
    assert layout.overlaps(1) == [SliceOverlap("b", 1, 0, 2)]


@pytest.mark.timeout(10)
def test_layout_more_ranks_than_elements():
    layout = FlatLayout.build([("a", (2,))], 5)
    assert (layout.shard_numel, layout.padded_numel) == (1, 5)
    assert [layout.valid_numel(r) for r in range(5)] == [1, 1, 0, 0, 0]
    assert [len(layout.overlaps(r)) for r in range(5)] == [1, 1, 0, 0, 0]


@pytest.mark.timeout(10)
def test_layout_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.build([("a", (2,))], 0)
