"""What zero_strategy needs of torch, checked when the package is imported: an install that is too old fails there
with a message naming the need, not in the middle of the first training step."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

MIN_TORCH = "2.6"


def check_torch() -> None:
    """Refuse a torch whose ``isend``/``irecv`` lack ``group_dst``/``group_src`` (added in torch 2.6): the
    point-to-point exchange (core/transport/point_to_point.py) addresses peers by their rank inside a process group."""
    if not dist.is_available():  # a build without torch.distributed: nothing here can run, say so at use
        return
    if "group_dst" not in inspect.signature(dist.isend).parameters:
        raise ImportError(
            f"zero_strategy needs torch >= {MIN_TORCH}, found torch {torch.__version__}: its point-to-point "
            "exchange passes group-relative ranks to torch.distributed.isend/irecv (group_dst/group_src, new in "
            f"torch {MIN_TORCH}). Upgrade with: pip install 'torch>={MIN_TORCH}'"
        )
