"""Test configuration shared by tests/unit, tests/distributed and tests/lightning.

``tests/`` has no ``__init__.py``; putting it on ``sys.path`` makes ``helpers`` importable from every test module
and from the processes Lightning's spawn launcher starts (they inherit ``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import torch  # noqa: E402

# The models here are tiny: one intra-op thread is faster than two fighting over the machine's two cores, and
# leaves a core for the other rank in multi-process tests.
torch.set_num_threads(1)
