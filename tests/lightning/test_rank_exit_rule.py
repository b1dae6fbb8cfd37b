"""`make test` retries a test once only when a spawned rank died after finishing its work
(see [Note: which rank deaths are retried] in tests/conftest.py and [Note: finished markers] in
zero_strategy/lightning/rank_exit.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.multiprocessing as mp
from helpers.lit import fit_lm
from helpers.rank_exits import RANK_FINISHED_DIR_ENV, die_by_signal, exited_after_finishing

import zero_strategy  # noqa: F401  (registers the strategy names)
from zero_strategy.lightning.rank_exit import FinishMarkingLauncher, finished_marker
from zero_strategy.testing import run_ranks


def _exit_of_a_rank_that_dies(marker_dir: Path, finish_first: bool) -> mp.ProcessExitedException:
    # Forked rather than spawned: torch's start_processes reports a rank's death the same way for every start
    # method (the rule under test reads only that report and the marker), and a fork skips a new interpreter.
    with pytest.raises(mp.ProcessExitedException) as caught:
        mp.start_processes(die_by_signal, args=(str(marker_dir), finish_first), nprocs=1, start_method="fork")
    return caught.value


@pytest.mark.timeout(60)
def test_only_a_death_after_the_finished_marker_is_retried(tmp_path: Path):
    during_work = _exit_of_a_rank_that_dies(tmp_path / "a", finish_first=False)
    assert exited_after_finishing(during_work, tmp_path / "a") is None
    (tmp_path / "b").mkdir()
    after_work = _exit_of_a_rank_that_dies(tmp_path / "b", finish_first=True)
    retry = exited_after_finishing(after_work, tmp_path / "b")
    assert retry is not None and type(retry).__name__ == "RankExitedAfterFinishing"


@pytest.mark.timeout(60)
def test_a_marker_left_by_an_earlier_fit_does_not_vouch_for_a_later_death(tmp_path: Path):
    # one test, two fits: rank 0 of the first finished (and died at exit), rank 0 of the second dies while working
    first = _exit_of_a_rank_that_dies(tmp_path, finish_first=True)
    assert exited_after_finishing(first, tmp_path) is not None
    second = _exit_of_a_rank_that_dies(tmp_path, finish_first=False)
    assert second.error_index == first.error_index and second.error_pid != first.error_pid
    assert exited_after_finishing(second, tmp_path) is None


class _Queue:
    """Lightning's return queue, noting whether the rank's finished marker already existed when results came."""

    def __init__(self, marker: Path) -> None:
        self.marker, self.marker_at_put = marker, None

    def put(self, results: object) -> None:
        self.marker_at_put = self.marker.exists()


def _launch_one_rank_in_this_process(rank, world_size, marker_dir, fails):
    """Lightning's per-rank entry (FinishMarkingLauncher._wrapping_function), called here in a forked process."""
    os.environ[RANK_FINISHED_DIR_ENV] = marker_dir
    marker = finished_marker(marker_dir, 0, os.getpid())
    marker.touch()  # as if an earlier process with this id had finished here: it must not count
    launcher = FinishMarkingLauncher(SimpleNamespace(accelerator=None, num_processes=1), start_method="fork")
    queue = _Queue(marker)
    seen_during_work = []

    def work() -> str:
        seen_during_work.append(marker.exists())
        if fails:
            raise RuntimeError("dies while working")
        return "results"

    try:
        launcher._wrapping_function(0, None, work, (), {}, queue)
    except RuntimeError:
        pass
    return {"during_work": seen_during_work, "at_put": queue.marker_at_put, "after": marker.exists()}


@pytest.mark.timeout(60)
def test_the_marker_is_written_last_after_the_results_were_handed_back(tmp_path: Path):
    done = run_ranks(_launch_one_rank_in_this_process, 1, str(tmp_path), False, timeout_s=40)[0]
    assert done == {"during_work": [False], "at_put": False, "after": True}
    failed = run_ranks(_launch_one_rank_in_this_process, 1, str(tmp_path), True, timeout_s=40)[0]
    assert failed == {"during_work": [False], "at_put": None, "after": False}


@pytest.mark.timeout(120)
def test_each_spawned_rank_of_a_fit_writes_a_marker_naming_its_process(tmp_path: Path):
    _, trainer = fit_lm("zero2_spawn", None, max_steps=1, limit_val_batches=0)
    marker_dir = Path(os.environ[RANK_FINISHED_DIR_ENV])  # set for this test by tests/conftest.py
    processes = trainer.strategy.launcher.procs
    expected = {finished_marker(marker_dir, rank, process.pid).name for rank, process in enumerate(processes)}
    assert len(expected) == 2 and {p.name for p in marker_dir.iterdir()} == expected
