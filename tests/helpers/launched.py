"""Ranks of ``zero_strategy.testing.run_ranks`` that Lightning takes for ranks torchrun started.

A Trainer or Fabric in a process whose environment names its LOCAL_RANK runs the fit in that process instead of
launching ranks, and adopts the process group run_ranks already made. Fits launched this way cost a fork (the
interpreter, torch and Lightning are already imported) instead of a new interpreter per rank, as the spawn and
popen launchers need: tests whose point is not the launcher run their fits this way, and several fits share one
launch. The launchers themselves keep tests of their own (``*_spawn`` and popen parametrizations).
"""

from __future__ import annotations

import os


def as_launched_rank(rank: int, world_size: int) -> None:
    """Set what torchrun sets for ``rank`` of ``world_size`` ranks on one node."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
