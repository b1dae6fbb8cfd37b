"""The gloo test harness itself: results come back per rank, failures and hangs become RankFailed quickly."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from zero_strategy.testing import RankFailed, run_ranks


def _sum_ranks(rank, world_size, scale):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": t * scale}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(world_size):
    results = run_ranks(_sum_ranks, world_size, 2.0, timeout_s=20)
    expected = 2.0 * sum(range(1, world_size + 1))
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["world"] == world_size
        torch.testing.assert_close(r["sum"], torch.full((3,), expected))


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone
    return rank


@pytest.mark.timeout(30)
def test_raising_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="deliberate failure on rank one") as info:
        run_ranks(_raise_on_rank_1, 2, timeout_s=20, pg_timeout_s=20)
    assert "rank 1" in str(info.value)
    assert time.monotonic() - start < 15, "a raising rank must not cost the whole timeout"


def _skip_collective_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(60)  # hangs without joining the collective rank 0 is waiting in
        return rank
    dist.all_reduce(torch.ones(1))
    return rank


@pytest.mark.timeout(40)
def test_rank_skipping_a_collective_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailed):
        run_ranks(_skip_collective_on_rank_1, 2, timeout_s=5, pg_timeout_s=2)
    # the failure is reported within the timeout; the rest is the harness reaping the hung rank
    assert time.monotonic() - start < 5 + 12


def _sleep_forever(rank, world_size):
    time.sleep(120)


@pytest.mark.timeout(40)
def test_hang_without_collective_hits_harness_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="did not finish"):
        run_ranks(_sleep_forever, 1, timeout_s=2, pg_timeout_s=60)
    assert time.monotonic() - start < 2 + 8
