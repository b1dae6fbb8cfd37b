"""`make test` retries a test once only when a spawned rank died after finishing its work
(see [Note: which rank deaths are retried] in tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from helpers.lit import fit_lm
from helpers.rank_exits import RANK_FINISHED_DIR_ENV, die_by_signal, exited_after_finishing

import zero_strategy  # noqa: F401  (registers the strategy names)


def _exit_of_a_rank_that_dies(marker_dir: Path, finish_first: bool) -> mp.ProcessExitedException:
    with pytest.raises(mp.ProcessExitedException) as caught:
        mp.start_processes(die_by_signal, args=(str(marker_dir), finish_first), nprocs=1, start_method="spawn")
    return caught.value


@pytest.mark.timeout(60)
def test_only_a_death_after_the_finished_marker_is_retried(tmp_path: Path):
    during_work = _exit_of_a_rank_that_dies(tmp_path / "a", finish_first=False)
    assert exited_after_finishing(during_work, tmp_path / "a") is None
    (tmp_path / "b").mkdir()
    after_work = _exit_of_a_rank_that_dies(tmp_path / "b", finish_first=True)
    retry = exited_after_finishing(after_work, tmp_path / "b")
    assert retry is not None and type(retry).__name__ == "RankExitedAfterFinishing"


@pytest.mark.timeout(120)
def test_spawned_ranks_write_their_finished_marker_at_teardown(tmp_path: Path):
    fit_lm("zero2_spawn", None, max_steps=1, limit_val_batches=0)
    marker_dir = Path(os.environ[RANK_FINISHED_DIR_ENV])  # set for this test by tests/conftest.py
    assert sorted(p.name for p in marker_dir.iterdir()) == ["rank0.finished", "rank1.finished"]
