"""Opening DeepSpeed's ``.pt`` files without DeepSpeed, safely.

[Note: DeepSpeed's pickles are untrusted input]
DeepSpeed writes its checkpoints with ``torch.save``: tensors and plain data, plus a few objects of its own
classes (its loss scaler, the ZeRO stage enum, the address of a parameter in a flat partition). A pickle may name
any importable callable, so a checkpoint from elsewhere could run code when it is opened. Every file is therefore
read with torch's ``weights_only`` unpickler, which builds nothing but tensors and plain containers, and only the
DeepSpeed classes the format needs are allowed, each mapped onto a stand-in of ours that holds the same fields
and runs no code of the file's choosing. A file naming any other class is refused with an error naming it. Files
are memory-mapped (``mmap=True``): a rank reading its ranges touches only the pages that hold them.
"""

from __future__ import annotations

import enum
import os
import pickle
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zero_strategy.checkpoint.base.format import CheckpointError


class LossScalerState:
    """Stand-in for DeepSpeed's ``LossScaler`` / ``DynamicLossScaler``: their attributes (``cur_scale``,
    ``cur_hysteresis``, ``last_overflow_iter``, ...), nothing else."""

    def __init__(self) -> None:
        self.__dict__: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        return dict(vars(self))


class ZeroStage(enum.IntEnum):
    """Stand-in for DeepSpeed's ``ZeroStageEnum`` (pickled by value)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4  # DeepSpeed's bound, never a checkpoint's stage


@dataclass(slots=False)
class FragmentAddress:
    """Stand-in for DeepSpeed's ``fragment_address``: where a parameter starts in its flat partition."""

    numel: int = 0
    start: int = 0


MAPPED: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}
"""The DeepSpeed classes a checkpoint may name, and what each becomes (see [Note: DeepSpeed's pickles are
untrusted input])."""

# torch's allow-list is process-wide state that a ``with`` block adds to and removes from; one load at a time in
# this process keeps two threads (ranks simulated in one process) from removing each other's entries.
_ALLOW_LOCK = threading.Lock()


def load_deepspeed_file(path: Path, what: str = "DeepSpeed checkpoint file") -> dict[str, Any]:
    """The dictionary DeepSpeed saved in ``path``, its tensors memory-mapped, its DeepSpeed objects as stand-ins.
    Raises :class:`CheckpointError` naming the file for a missing, damaged or unsafe file (one naming a class
    outside :data:`MAPPED` and torch's tensor types)."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing ({what})")
    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        (stand_in, name) for name, stand_in in MAPPED.items()
    ]
    try:
        with _ALLOW_LOCK, torch.serialization.safe_globals(allowed):
            loaded = torch.load(os.fspath(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} was refused: it names a class a DeepSpeed checkpoint does not hold ({_refused_name(error)}); "
            f"only tensors, plain data and DeepSpeed's {', '.join(sorted(MAPPED))} are read, since unpickling "
            "anything else could run code from the file"
        ) from error
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as error:
        raise CheckpointError(f"{path} could not be read as a {what}: {error}") from error
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not the dictionary a {what} holds")
    return loaded


def _refused_name(error: pickle.UnpicklingError) -> str:
    """The class or function torch's unpickler refused, from its message (the whole message if not found)."""
    text = str(error)
    for marker in ("GLOBAL ", "unrecognized function ", "but got "):
        if marker in text:
            return text.split(marker, 1)[1].split(" ", 1)[0].rstrip(".,")
    return " ".join(text.split())[:300]
