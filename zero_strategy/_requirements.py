"""What zero_strategy needs of torch, checked when the package is imported: an install that is too old fails there
with a message naming the need, not in the middle of the first training step.

The check reads torch's version number, never the shape of a torch function: a profiler or logger that wraps
``torch.distributed.isend`` (without ``functools.wraps``) must not make a current torch look old.
"""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 13)
"""The oldest torch the test suite runs on. The code itself needs at least torch 2.6 (``isend``/``irecv`` with
``group_dst``/``group_src``), and sharded construction recognizes the ``nn.init`` functions that skip meta tensors
by torch 2.13's code (see [Note: nn.init functions that skip meta tensors] in core/init/profile_hook.py);
versions in between are not tested, so they are refused. A newer torch is not refused here: pip keeps to the range
below on install, and a torch forced past it is the user's informed choice."""

SUPPORTED_TORCH = "torch>=2.13,<2.14"
"""The range pyproject.toml states (tests/unit/test_requirements.py holds the two in agreement)."""


def parse_torch_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version: ``"2.13.0+cpu"``, ``"2.14.0a0+git1234"``, ``"2.13.0.dev20250101"``."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(
            f"zero_strategy cannot read torch's version {version!r} (expected major.minor...): install a released "
            f"torch: pip install '{SUPPORTED_TORCH}'"
        )
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str | None = None) -> None:
    """Refuse a torch older than :data:`MIN_TORCH` (``version``: torch's own ``torch.__version__`` by default)."""
    found = str(torch.__version__ if version is None else version)
    if parse_torch_version(found) < MIN_TORCH:
        oldest = ".".join(str(part) for part in MIN_TORCH)
        raise ImportError(
            f"zero_strategy needs torch >= {oldest}, found torch {found}: older versions are not tested (sharded "
            "construction depends on how torch's nn.init treats meta tensors; the point-to-point exchange needs "
            f"torch.distributed.isend/irecv with group_dst/group_src). Upgrade with: pip install '{SUPPORTED_TORCH}'"
        )
