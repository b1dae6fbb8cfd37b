"""A DeepSpeed checkpoint's module state dict: what ``zero-to-fp32`` writes from it and what
``pretrained=DEEPSPEED_DIR`` reads from it, key by key.

The keys are the module's ``state_dict`` keys in the saved order (DeepSpeed keeps every key in its model-states
``module`` entry, even at stage 3, where the values there are empty), relative to the user's module (Lightning's
wrapper prefix removed). A parameter reads as its fp32 master weights (a frozen one as stored, in fp32), a tied key
as the parameter it is tied to (DeepSpeed's ``shared_params``), a buffer as stored, in its own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint, local_name


@dataclass(frozen=True, slots=True)
class Key:
    """One state-dict key: the parameter behind it (None for a buffer) and its shape."""

    key: str
    param: str | None
    shape: tuple[int, ...]


def state_dict_keys(ckpt: DeepSpeedCheckpoint) -> list[Key]:
    """The module's state-dict keys in order, each with its parameter (tied keys name their source)."""
    module = ckpt.model_states.get("module") or {}
    buffers = ckpt.buffers()
    keys: list[Key] = []
    for stored in module:
        key = local_name(stored)
        if key in buffers:
            keys.append(Key(key, None, tuple(buffers[key].shape)))
        elif key in ckpt.params:
            keys.append(Key(key, ckpt.aliases.get(key, key), tuple(ckpt.params[key][1].shape)))
        else:
            raise CheckpointError(
                f"{ckpt.files.model_states}: module key {stored!r} is neither a buffer nor a parameter of "
                "param_shapes / frozen_param_shapes / shared_params"
            )
    listed = {k.key for k in keys}
    keys += [Key(name, ckpt.aliases.get(name, name), tuple(ckpt.params[name][1].shape))
             for name in ckpt.params if name not in listed]  # a module entry DeepSpeed left out (none seen)
    return keys


def read_key(ckpt: DeepSpeedCheckpoint, key: Key, start: int = 0, count: int | None = None) -> Tensor:
    """Elements ``[start, start + count)`` of ``key`` (all by default), 1-D: fp32 for a parameter."""
    if key.param is not None:
        return ckpt.read_param(key.param, "flat", start, count)
    value = ckpt.buffers()[key.key].reshape(-1)
    end = value.numel() if count is None else start + count
    return value[start:end].detach().clone()
