"""A spawned rank tells its launching harness that its work is done: Lightning's spawn launcher, with a finished
marker written as each rank's very last act.

[Note: finished markers]
With ``$ZERO_STRATEGY_RANK_FINISHED_DIR`` set, each rank a spawn-style ZeroStrategy launches writes
``rank<local rank>.pid<process id>.finished`` into that directory after everything it had to do, Lightning's
hand-back of rank 0's results to the main process included (``SimpleQueue.put`` has written them into the pipe
when it returns). A harness that sees a rank die can then tell a rank killed at interpreter exit, after its work
(worth a retry: this project's test suite retries those once), from one that died while working (a failure). The
marker names the process, not only the rank: every fit's ranks are new processes, so a marker left by an earlier
fit in the same directory never vouches for a later one; a marker a process finds under its own name at start
(an earlier process with the same id, ids being reused) is removed first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

RANK_FINISHED_DIR_ENV = "ZERO_STRATEGY_RANK_FINISHED_DIR"


def finished_marker(directory: str | os.PathLike, local_rank: int, pid: int) -> Path:
    """Where the process ``pid`` running ``local_rank`` writes its finished marker (see [Note: finished markers])."""
    return Path(directory) / f"rank{local_rank}.pid{pid}.finished"


def _own_marker(local_rank: int) -> Path | None:
    directory = os.environ.get(RANK_FINISHED_DIR_ENV)
    return finished_marker(directory, local_rank, os.getpid()) if directory else None


class FinishMarkingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for spawn/fork/forkserver ranks, whose ranks each write a finished marker last."""

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        marker = _own_marker(process_idx)
        if marker is not None:
            marker.unlink(missing_ok=True)  # an earlier process's, with the same id
        super()._wrapping_function(process_idx, *args, **kwargs)
        if marker is not None:  # last: the fit, teardown and the hand-back of rank 0's results have returned
            marker.touch()
