"""Telling a spawned rank that died after finishing its work from one that died while working
(see [Note: which rank deaths are retried] in tests/conftest.py and [Note: finished markers] in
zero_strategy/lightning/rank_exit.py)."""

from __future__ import annotations

from pathlib import Path

from torch.multiprocessing import ProcessExitedException

from zero_strategy.lightning.rank_exit import RANK_FINISHED_DIR_ENV, finished_marker

__all__ = ["RANK_FINISHED_DIR_ENV", "RankExitedAfterFinishing", "die_by_signal", "exited_after_finishing"]


class RankExitedAfterFinishing(RuntimeError):
    """A spawned rank was killed at process exit after it had reported its work finished: worth one rerun."""


def exited_after_finishing(error: ProcessExitedException, marker_dir: Path) -> RankExitedAfterFinishing | None:
    """The retryable form of ``error`` if the process that died (its rank *and* process id) had written its
    finished marker into ``marker_dir``; None if it died while working (a failure, never retried)."""
    if not finished_marker(marker_dir, error.error_index, error.error_pid).exists():
        return None
    return RankExitedAfterFinishing(
        f"rank {error.error_index} (process {error.error_pid}) finished its work, then died at exit "
        f"(exit code {error.exit_code})"
    )


def die_by_signal(rank: int, marker_dir: str, finish_first: bool) -> None:
    """A rank started by torch.multiprocessing, killed by SIGKILL after (``finish_first``) or before writing its
    finished marker."""
    import os
    import signal

    if finish_first:
        finished_marker(marker_dir, rank, os.getpid()).touch()
    os.kill(os.getpid(), signal.SIGKILL)
