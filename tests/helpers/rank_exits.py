"""Telling a spawned rank that died after finishing its work from one that died while working
(see [Note: which rank deaths are retried] in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from torch.multiprocessing import ProcessExitedException

RANK_FINISHED_DIR_ENV = "ZERO_STRATEGY_RANK_FINISHED_DIR"


class RankExitedAfterFinishing(RuntimeError):
    """A spawned rank was killed at process exit after it had reported its work finished: worth one rerun."""


def exited_after_finishing(error: ProcessExitedException, marker_dir: Path) -> RankExitedAfterFinishing | None:
    """The retryable form of ``error`` if the dead rank had written its ``rank<N>.finished`` marker into
    ``marker_dir``; None if it died while working (a failure, never retried)."""
    if not (marker_dir / f"rank{error.error_index}.finished").exists():
        return None
    return RankExitedAfterFinishing(
        f"rank {error.error_index} finished its work, then died at exit (exit code {error.exit_code})"
    )


def die_by_signal(rank: int, marker_dir: str, finish_first: bool) -> None:
    """A spawned rank killed by SIGKILL, after (``finish_first``) or before writing its finished marker."""
    import os
    import signal

    if finish_first:
        (Path(marker_dir) / f"rank{rank}.finished").touch()
    os.kill(os.getpid(), signal.SIGKILL)
