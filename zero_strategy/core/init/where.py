"""Names the module code that was running, so that errors point at the user's line."""

from __future__ import annotations

import types

from torch import nn

_CALLERS_SHOWN = 3


def module_code_in_frames(frame: types.FrameType | None) -> str:
    """`in Class.method (file:line), called from ...`: the innermost frames whose `self` is an `nn.Module`."""
    found: list[str] = []
    while frame is not None and len(found) < _CALLERS_SHOWN:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            code = frame.f_code
            found.append(f"{type(owner).__name__}.{code.co_name} ({code.co_filename}:{frame.f_lineno})")
        frame = frame.f_back
    if not found:
        return "outside any nn.Module method"
    return "in " + ", called from ".join(found)


def rng_remedy() -> str:
    return (
        "Inside the build, draw random numbers only for tensors the build creates on the default device (no "
        "device= argument: they are recorded and replayed), or build this model eagerly. Reseeding inside the build "
        "(torch.manual_seed, set_rng_state, fork_rng) is fine."
    )
