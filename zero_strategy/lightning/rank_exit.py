"""A spawned rank tells its launching harness that its work is done (see report_rank_finished)."""

from __future__ import annotations

import os
from pathlib import Path

RANK_FINISHED_DIR_ENV = "ZERO_STRATEGY_RANK_FINISHED_DIR"


def report_rank_finished(local_rank: int) -> None:
    """Tell a launching harness that this spawned rank's work is done: with ``$ZERO_STRATEGY_RANK_FINISHED_DIR``
    set, write ``rank<local rank>.finished`` there. A harness can then tell a rank killed at interpreter exit
    (worth a retry) from one that died while training (a failure); this project's test suite does."""
    directory = os.environ.get(RANK_FINISHED_DIR_ENV)
    if directory:
        (Path(directory) / f"rank{local_rank}.finished").touch()
