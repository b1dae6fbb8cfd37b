"""The gloo test harness itself: results come back per rank, failures and hangs become RankFailed quickly."""

from __future__ import annotations

import faulthandler
import os
import re
import signal
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


# ---------------------------------------------------------------------------------------------- crashes
def _die(how: str) -> None:
    if how == "segfault":
        faulthandler.disable()  # (pytest's faulthandler would print this deliberate crash's stack)
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os._exit(3)


def _rank_1_dies_mid_work(rank, world_size, how):
    if rank == 1:
        _die(how)
    dist.all_reduce(torch.ones(1))  # rank 0 waits for its peer in a collective (process-group timeout: 60 s)
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "words"),
    [("segfault", "killed by signal SIGSEGV"), ("killed", "killed by signal SIGKILL"), ("exit", "exited with code 3")],
)
def test_a_rank_that_dies_mid_work_is_reported_at_once_as_a_crash(how, words):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank_1_dies_mid_work, 2, how, timeout_s=40, pg_timeout_s=60)
    elapsed = time.monotonic() - start
    first = str(info.value).splitlines()[0]
    assert first == f"rank 1 crashed: {words} (before returning a result)", str(info.value)
    assert "did not finish" not in str(info.value)  # not taken for a hang
    assert elapsed < 15, f"a crash must be reported when it happens, not at the timeout ({elapsed:.1f} s)"


def _rank_1_dies_after_returning(rank, world_size, how):
    from multiprocessing.util import Finalize

    dist.all_reduce(torch.ones(1))
    if rank == 1:
        # runs at process exit, after the harness's entry point sent the result and returned
        Finalize(None, _die, args=(how,), exitpriority=0)
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "words"), [("segfault", "killed by signal SIGSEGV"), ("exit", "exited with code 3")])
def test_a_rank_that_dies_after_returning_its_result_is_a_crash_too(how, words):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=re.escape(f"rank 1 crashed: {words} (after returning its result)")):
        run_ranks(_rank_1_dies_after_returning, 2, how, timeout_s=40)
    assert time.monotonic() - start < 15


def _rank_1_leaves_quietly(rank, world_size):
    if rank == 1:
        os._exit(0)
    return rank


@pytest.mark.timeout(60)
def test_a_rank_that_exits_cleanly_without_a_result_is_a_failure():
    with pytest.raises(RankFailed, match=r"rank 1 exited \(code 0\) without returning a result"):
        run_ranks(_rank_1_leaves_quietly, 2, timeout_s=40)


@pytest.mark.timeout(60)
def test_survivors_grace_also_reports_how_the_other_ranks_ended():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank_1_dies_mid_work, 2, "exit", timeout_s=40, pg_timeout_s=3, survivors_grace_s=25)
    message = str(info.value)
    # the crash first, then what it did to rank 0 (its collective failed, well before the grace ran out)
    assert message.startswith("rank 1 crashed: exited with code 3") and "\nrank 0 raised:" in message, message
    assert time.monotonic() - start < 20
