"""Reading a plain single-file checkpoint for ``consolidate`` / ``zero-to-fp32``: a Lightning ``.ckpt`` (a dict
with a ``state_dict``), or a ``torch.save``'d state_dict. Such a file already holds every tensor whole; the tool
converts it to the requested output rather than refusing it, so one command handles whatever a run left behind
(a DDP run's checkpoint, a consolidated ``.ckpt``, a checkpoint saved by an older zero_strategy after fit)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import CheckpointError


def read_plain_checkpoint(path: Path, weights_only: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(state_dict with floating-point tensors in fp32, Lightning's other entries or None for a bare state_dict).

    A plain file does not say which entries are parameters and which are buffers, so every floating-point tensor
    becomes fp32 (the tool's promise for parameters); integer tensors (step counters) keep their dtype."""
    try:
        content = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as error:
        hint = (
            " It holds objects beyond plain data (often hyper-parameters); if you trust it, pass "
            "weights_only=False."
            if weights_only
            else ""
        )
        raise CheckpointError(
            f"{path} is a file, so it was read as a torch / Lightning checkpoint, and torch.load failed "
            f"(weights_only={weights_only}): {error}.{hint}"
        ) from error
    if isinstance(content, dict) and isinstance(content.get("state_dict"), dict):
        state_dict, rest = content["state_dict"], {k: v for k, v in content.items() if k != "state_dict"}
    elif isinstance(content, dict) and content and all(isinstance(v, Tensor) for v in content.values()):
        state_dict, rest = content, None
    else:
        raise CheckpointError(
            f"{path} is neither a zero_strategy sharded checkpoint directory, nor a Lightning checkpoint (a dict "
            "with a 'state_dict'), nor a torch state_dict (a dict of tensors)."
        )
    converted = {
        key: value.float() if isinstance(value, Tensor) and value.is_floating_point() else value
        for key, value in state_dict.items()
    }
    return converted, rest
