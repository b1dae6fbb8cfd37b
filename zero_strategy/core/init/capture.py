"""Capture: construction runs on the meta device while every op that makes or changes a tensor is written into a
:class:`Recording` (record.py); what op-level recording cannot see goes through the profile hook (profile_hook.py)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zero_strategy.core.init.distributed_origins import noting_distributed_origins
from zero_strategy.core.init.ops import DeferredInitError, is_random
from zero_strategy.core.init.profile_hook import profile_hook
from zero_strategy.core.init.record import Recording
from zero_strategy.core.init.where import module_code_in_frames, rng_remedy

aten = torch.ops.aten
_META = torch.device("meta")
_DATA_CONSTRUCTORS = (torch.tensor, torch.as_tensor, torch.asarray)
_DATA_DEPENDENT = frozenset({aten._local_scalar_dense, aten.equal, aten.is_nonzero})


class _RecordOps(TorchDispatchMode):
    """Sees every aten op while recording; records those that touch meta tensors."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        touches_meta = any(isinstance(v, Tensor) and v.is_meta for v in flat_in) or kwargs.get("device") == _META
        if touches_meta and func.overloadpacket in _DATA_DEPENDENT:
            raise DeferredInitError(
                f"{func} reads a tensor's value ({module_code_in_frames(sys._getframe(1))}), but construction on "
                f"the meta device has no values: initialization must not read tensor values (.item(), .tolist(), "
                f"bool(tensor), numpy). Build this model eagerly, or move that code to reset_parameters() or a "
                f"hook that runs after setup."
            )
        if not touches_meta and is_random(func) and self.recording._black_box_frame is None:
            raise DeferredInitError(
                f"{func} drew random numbers for a real (non-meta) tensor during construction on the meta device "
                f"({module_code_in_frames(sys._getframe(1))}); replay could not reproduce them. {rng_remedy()}"
            )
        out = func(*args, **kwargs)
        if self.recording._black_box_frame is not None:  # part of a call recorded as a whole
            return out
        if touches_meta or any(isinstance(v, Tensor) and v.is_meta for v in tree_flatten(out)[0]):
            self.recording.record(func, args, kwargs, out)
        return out


# `torch.get_default_device()` answers "cpu" by making `torch.tensor([])` and reading its device. Under the
# recording that probe would say "meta", and code that stores the answer (a torchmetrics Metric's `device`, used
# to place tensors after the build) would keep placing them on the meta device: the probe is left alone.
_DEFAULT_DEVICE_PROBE = next(
    (
        code
        for code in torch.get_default_device.__code__.co_consts
        if isinstance(code, types.CodeType) and code.co_name == "_get_device_with_index"
    ),
    None,
)


class _DefaultToMeta(TorchFunctionMode):
    """Like `torch.device("meta")`, except that tensors made from data keep their values (a recorded copy)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if sys._getframe(1).f_code is _DEFAULT_DEVICE_PROBE:
            return func(*args, **kwargs)
        if func is Tensor.new_tensor and args[0].is_meta and kwargs.get("device") is None:
            kwargs.setdefault("dtype", args[0].dtype)
            return torch.tensor(args[1], **kwargs, device="cpu").to(_META)
        if func in _device_constructors() and kwargs.get("device") is None:
            holds_meta = any(isinstance(v, Tensor) and v.is_meta for v in tree_flatten((args, kwargs))[0])
            if func in _DATA_CONSTRUCTORS and not holds_meta:
                # torch.tensor(data, device="meta") would drop the data without any op to record.
                return func(*args, **{**kwargs, "device": "cpu"}).to(_META)
            kwargs["device"] = _META
        return func(*args, **kwargs)


@contextmanager
def record_construction(device: torch.device | str = "cpu") -> Iterator[Recording]:
    """Build under this context: tensors land on the meta device and the returned recording can replay them.

    `device` is where the values will be replayed; its default generator is the one the build draws from,
    exactly as an eager build on that device would.
    """
    recording = Recording(torch.device(device))
    with _recording_into(recording):
        yield recording


@contextmanager
def continue_recording(recording: Recording, where: str) -> Iterator[Recording]:
    """Record more ops on the meta tensors of an earlier recording (and new ones), as if they followed its build
    at this moment: replay runs them after the build's, each tracked generator first set to the state it has now
    (rank 0's, once the ranks agree), whatever moved it since the build ended."""
    for generator in recording.generators.tracked():
        recording.record_set_state(generator, where)
    with _recording_into(recording):
        yield recording


@contextmanager
def _recording_into(recording: Recording) -> Iterator[None]:
    try:
        with (
            profile_hook(recording),
            noting_distributed_origins(recording.distributed, recording.recorded_ref, recording.last_op),
            _DefaultToMeta(),
            _RecordOps(recording),
        ):
            yield
        recording.check_generators("detected when the build finished")
    except DeferredInitError:
        raise
    except (RuntimeError, NotImplementedError, TypeError) as error:
        if "meta" not in str(error):
            raise
        raise DeferredInitError(
            f"construction on the meta device failed ({module_code_in_frames(_innermost_frame(error))}): "
            f"{error}. Initialization must not read tensor values (.item(), .tolist(), numpy, copying to the "
            f"host). Build this model eagerly, or move that code to reset_parameters() or a hook that runs "
            f"after setup."
        ) from error
    finally:
        recording.generators.finish()


def _innermost_frame(error: BaseException) -> types.FrameType | None:
    traceback = error.__traceback__
    frame = None
    while traceback is not None:
        frame = traceback.tb_frame
        traceback = traceback.tb_next
    return frame
