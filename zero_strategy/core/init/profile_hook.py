"""What op-level recording cannot see, seen through a profile hook: whole `torch.nn.init` calls that skip meta
tensors, and generator reseeds (see [Note: reseeds inside the build] in generators.py)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor

from zero_strategy.core.init.generators import RESEEDING_METHODS
from zero_strategy.core.init.where import module_code_in_frames


class Recording(Protocol):
    """What the hook writes to (core/init/record.py's Recording; a protocol, so the two modules import one way)."""

    _black_box_frame: types.FrameType | None

    def record_black_box(self, fn: Callable[..., Any], bound: dict[str, Any], where: str) -> None: ...

    def record_set_state(self, generator: torch.Generator, where: str) -> None: ...

    def check_seed_read(self, generator: torch.Generator, where: str) -> None: ...

# [Note: nn.init functions that skip meta tensors]
# In torch 2.13, `trunc_normal_`, `orthogonal_`, `sparse_` and `dirac_` return at once when given a meta
# tensor (they test `tensor.is_meta`), so op-level recording sees nothing: the values, and the random numbers
# they consume, would be lost silently. `trunc_normal_` is also rejection sampling now: how many numbers it
# draws depends on the numbers drawn, which no meta recording can know. These functions are therefore recorded
# as whole calls (found through a profile hook, so `from torch.nn.init import trunc_normal_` is caught too)
# and replayed by calling them again on the real tensor. They are found by their code, not by name.
BLACK_BOX_CODES: dict[types.CodeType, Callable[..., Any]] = {
    fn.__code__: fn
    for fn in vars(torch.nn.init).values()
    if isinstance(fn, types.FunctionType) and "is_meta" in fn.__code__.co_names
}


@contextmanager
def profile_hook(recording: Recording) -> Iterator[None]:
    """A profile hook that records what op-level recording cannot see: calls of the functions in
    `BLACK_BOX_CODES` made on meta tensors, and generator reseeds (see [Note: reseeds inside the build])."""
    previous = sys.getprofile()

    def hook(frame: types.FrameType, event: str, arg: Any) -> None:
        if recording._black_box_frame is None:
            if event == "call" and frame.f_code in BLACK_BOX_CODES:
                _enter_black_box(recording, frame)
            elif event == "c_return" and isinstance(getattr(arg, "__self__", None), torch.Generator):
                _generator_method_returned(recording, arg, frame)
        elif event == "return" and frame is recording._black_box_frame:
            recording._black_box_frame = None
        if previous is not None:
            previous(frame, event, arg)  # type: ignore[arg-type]

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)


def _enter_black_box(recording: Recording, frame: types.FrameType) -> None:
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    bound = {name: frame.f_locals[name] for name in names}
    if any(isinstance(v, Tensor) and v.is_meta for v in bound.values()):
        recording.record_black_box(BLACK_BOX_CODES[code], bound, module_code_in_frames(frame.f_back))
        recording._black_box_frame = frame


def _generator_method_returned(recording: Recording, method: Any, frame: types.FrameType) -> None:
    if method.__name__ in RESEEDING_METHODS:
        recording.record_set_state(method.__self__, module_code_in_frames(frame))
    elif method.__name__ == "initial_seed":
        recording.check_seed_read(method.__self__, module_code_in_frames(frame))
