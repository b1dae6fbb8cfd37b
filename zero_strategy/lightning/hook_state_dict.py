"""The state dict Lightning's checkpoint hooks see, and what their edits mean.

[Note: the state dict in Lightning's hooks]
Lightning hands ``on_save_checkpoint`` / ``on_load_checkpoint`` (the module's and the callbacks') the checkpoint
dict, whose ``"state_dict"`` code edits to drop a frozen backbone or rename keys. Under ZeRO the values are never
whole on one rank (each rank writes and reads its own slices), so, as FSDP's sharded state dict does, the hooks get
every key with a placeholder value: a tensor on the meta device with the parameter's shape and dtype (buffers, which
every rank holds whole, are real). What the hooks do to the keys takes effect:

- saving: a key removed is left out of the checkpoint (its parameter too, once all its keys are gone: a missing key
  on resume, as with DDP); a placeholder moved under another key is written under that key (the manifest and the
  consolidated file use the new name). Putting a different value under a key (a tensor that is not the key's own
  placeholder) or adding one cannot be honoured — the weights are written from the shards — and raises, naming the
  key and the way to change weights (through the module, inside ``gathered_parameters()``, before saving).
- loading: the same, read the other way: a key removed is not loaded (strict loading then reports it missing, as
  with DDP), a checkpoint's placeholder put under another key is loaded into the parameter of that key. A real
  tensor put in place of a placeholder raises (the weights are read by each rank from the files, not from that
  tensor).
``optimizer_states`` stays a list of empty dicts: each rank writes its own slices of the optimizer state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.base.source import ReadableCheckpoint


def _placeholder(tensor: Tensor) -> Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def save_placeholders(module: nn.Module) -> dict[str, Tensor]:
    """Every state-dict key of ``module`` with a meta placeholder (keep_vars: nothing is gathered)."""
    return {key: _placeholder(value) if isinstance(value, Tensor) else value
            for key, value in module.state_dict(keep_vars=True).items()}


def _edits(edited: Mapping[str, Any], given: Mapping[str, Any], when: str) -> dict[str, str | None]:
    """``given`` key → its key in ``edited`` (None: removed), raising where a value was replaced or added."""
    by_identity = {id(value): key for key, value in given.items()}
    moved: dict[str, str | None] = dict.fromkeys(given)
    for key, value in edited.items():
        source = by_identity.get(id(value))
        if source is None:
            if isinstance(value, Tensor) and not value.is_meta and key in given and torch.is_tensor(given[key]) \
                    and not given[key].is_meta:
                moved[key] = key  # a buffer handed over whole, given back (or edited in place: it is real)
                continue
            raise CheckpointError(
                f"the {when} hook put a value of its own under state-dict key {key!r}; under ZeRO the weights are "
                "written and read by each rank from its own slices, so only keys can be edited (removed or "
                "renamed). Change weights through the module (inside trainer.strategy.gathered_parameters()) "
                "before saving, or after loading."
            )
        moved[source] = key
    return moved


def renames_after_save_hooks(edited: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, str | None]:
    """Old key → new key (None: left out) for the keys the save hooks moved or removed."""
    return {key: new for key, new in _edits(edited, given, "on_save_checkpoint").items() if new != key}


def load_placeholders(checkpoint: ReadableCheckpoint, buffers: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's parameters (placeholders with their shapes and dtypes) and its buffers (real)."""
    given: dict[str, Any] = {}
    for name, (flat, param) in checkpoint.params.items():
        given[name] = torch.empty(param.shape, dtype=getattr(torch, flat.dtype), device="meta")
    given.update(buffers)
    return given


def names_after_load_hooks(edited: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, str] | None:
    """For each parameter the load hooks kept: the name it is loaded into → its name in the checkpoint; None when
    the hooks changed nothing."""
    moved = _edits(edited, given, "on_load_checkpoint")
    if all(new == key for key, new in moved.items()):
        return None
    return {new: key for key, new in moved.items() if new is not None}
