"""Test configuration shared by tests/unit, tests/distributed and tests/lightning.

``tests/`` has no ``__init__.py``; putting it on ``sys.path`` makes ``helpers`` importable from every test module
and from the processes Lightning's spawn launcher starts (they inherit ``sys.path``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import torch  # noqa: E402

# --network-pass and the stage3 marker: the second pass of `make test` (see [Note: the two paths of stage 3] there)
pytest_plugins = ("network_path",)

# The models here are tiny: one intra-op thread is faster than two fighting over the machine's two cores, and
# leaves a core for the other rank in multi-process tests.
torch.set_num_threads(1)


# [Note: which rank deaths are retried]
# A spawn-launched rank is now and then killed by a signal at interpreter exit, after its work is done (a gloo
# shutdown abort: "terminate called without an active exception"). Such a test is worth one rerun (`make test`
# passes --reruns 1 --only-rerun RankExitedAfterFinishing); a rank that dies *during* its work is a real failure.
# Each test gets its own directory in $ZERO_STRATEGY_RANK_FINISHED_DIR (spawned ranks inherit it from here); every
# rank a ZeroStrategy launches writes its finished marker there as its last act, named by its rank and process id
# (see [Note: finished markers] in zero_strategy/lightning/rank_exit.py). A ProcessExitedException is renamed only
# when the very process that died wrote its marker: a marker of another fit's rank in the same test does not count.
from helpers.rank_exits import RANK_FINISHED_DIR_ENV, exited_after_finishing  # noqa: E402
from torch.multiprocessing import ProcessExitedException  # noqa: E402

# A fit in this process (seed_everything, a spawn launcher) leaves launcher variables behind (PL_GLOBAL_SEED, RANK,
# MASTER_PORT...): each test ends by giving them back the values the session started with, so that no test's
# result depends on which ran before it (forked ranks get the same, see [Note: a forked rank starts fresh] in
# zero_strategy/testing.py).
from zero_strategy.testing import restore_launcher_environment  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with tempfile.TemporaryDirectory(prefix="rank-finished-") as marker_dir:
        os.environ[RANK_FINISHED_DIR_ENV] = marker_dir
        try:
            return (yield)
        except ProcessExitedException as error:
            retry = exited_after_finishing(error, Path(marker_dir))
            if retry is None:
                raise
            raise retry from error
        finally:
            os.environ.pop(RANK_FINISHED_DIR_ENV, None)
            restore_launcher_environment()
