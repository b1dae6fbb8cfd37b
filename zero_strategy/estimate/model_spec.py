"""``zero-estimate --model package.module:ClassName``: the class built on the meta device, never for real.

[Note: the estimator never builds a model for real]
An estimate reads shapes only, and the model it is asked about is often one that does not fit the machine (the
65 B example in ``zero-estimate --help`` needs hundreds of GB). So the class is built with every tensor factory
sent to the meta device, an explicit ``device="cpu"`` or ``device="cuda"`` in the constructor included (plain
``torch.device("meta")`` leaves those on their device). A constructor that cannot run there (it reads a tensor's
value with ``.item()``/``.tolist()``/numpy, copies a tensor to the host, ...) is an error naming the line that
failed and what the user can do, never a fallback to a real build. Tensors the constructor makes outside torch's
factories (``torch.from_numpy``, ``torch.load``) are the user code's own allocations; the estimate reads their
shapes like any other.
"""

from __future__ import annotations

import importlib
import json
import linecache
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

_META = torch.device("meta")
# Frames inside these packages are not the user's line: the error names the innermost frame outside them.
_LIBRARY_DIRS = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[1]))


class MetaBuildError(ValueError):
    """``--model`` could not be built on the meta device (or not found); the message says where and what to do."""


class _EveryFactoryOnMeta(TorchFunctionMode):
    """Sends every tensor factory (``torch.empty``, ``torch.zeros``, ``nn.Linear``'s parameters, ...) to the meta
    device, overriding an explicit ``device=``: see [Note: the estimator never builds a model for real]."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _device_constructors():
            kwargs["device"] = _META
        return func(*args, **kwargs)


def build_on_meta(cls: type[nn.Module], kwargs: dict[str, Any], spec: str) -> nn.Module:
    """``cls(**kwargs)`` with all its tensors on the meta device, or :class:`MetaBuildError` naming the failing line."""
    try:
        with _EveryFactoryOnMeta():
            return cls(**kwargs)
    except Exception as error:  # any failure: reported with its line below, never retried as a real build
        raise MetaBuildError(
            f"--model {spec}: building it on the meta device failed {_user_line(error)}: "
            f"{type(error).__name__}: {error}. zero-estimate reads shapes only and never builds a model for real "
            "(that could need as much memory as training it). Make that part of the constructor shape-only (no "
            ".item(), .tolist(), numpy or copies of tensor values to the host; move them to setup or forward), "
            "pass --model-kwargs for a configuration that builds, or estimate from counts: --params N "
            "[--largest-unit-params N --root-unit-params N]."
        ) from error


def load_model(spec: str, kwargs_json: str | None) -> nn.Module:
    """``package.module:ClassName`` built with no arguments (or the JSON keywords) on the meta device only."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise MetaBuildError(f"--model {spec!r}: use package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise MetaBuildError(f"--model {spec}: cannot import {module_name!r} ({error}); is it on PYTHONPATH?") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        found = "nothing" if cls is None else type(cls).__name__
        raise MetaBuildError(f"--model {spec}: {module_name}.{class_name} is {found}, not an nn.Module class")
    try:
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except json.JSONDecodeError as error:
        raise MetaBuildError(f"--model-kwargs is not valid JSON ({error}): {kwargs_json}") from None
    if not isinstance(kwargs, dict):
        raise MetaBuildError(f"--model-kwargs must be a JSON object of keywords, got {kwargs_json}")
    return build_on_meta(cls, kwargs, spec)


def _user_line(error: BaseException) -> str:
    """``at file:line in function (`source`)``: the innermost frame of the traceback outside torch and this
    package, the user's line that led to the failure."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_LIBRARY_DIRS)]
    if not frames:
        return "inside torch"
    frame = frames[-1]
    source = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f"at {frame.filename}:{frame.lineno} in {frame.name} (`{source}`)"
