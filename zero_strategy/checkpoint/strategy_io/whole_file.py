"""One file holding a whole state: written by one rank, read memory-mapped by every rank (each keeps its ranges);
and a plain state dict of any pretrained kind loaded into an engine's slices. What Fabric's ``state_dict_type=
"full"`` save and its ``load`` / ``load_raw`` do below the adapter (see [Note: the consolidated Fabric file] in
checkpoint/strategy_io/full_state.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.base.loadable import LoadTarget
from zero_strategy.checkpoint.pretrained.keys import alias_groups, expected_shapes, match_keys
from zero_strategy.checkpoint.pretrained.open import open_pretrained
from zero_strategy.core.init.materialize import Pretrained, load_pretrained


def write_whole_file(path: Path, content: dict[str, Any]) -> None:
    """``torch.save`` of ``content`` at ``path`` through a hidden partial name: a crash mid-save leaves the previous
    file. One writer: the caller makes sure only one rank calls it."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; the consolidated checkpoint is one file")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    torch.save(content, partial)
    os.replace(partial, path)


def read_whole_file(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """A consolidated checkpoint, memory-mapped (every rank reads it; each copies only its ranges)."""
    if not path.is_file():
        raise CheckpointError(f"{path} is neither a ZeRO sharded checkpoint directory nor a checkpoint file")
    safe = True if weights_only is None else weights_only
    return dict(torch.load(path, mmap=True, map_location="cpu", weights_only=safe))


def load_raw_module(engine: LoadTarget, path: Path, strict: bool) -> None:
    """A whole state dict (any pretrained kind ``open_pretrained`` reads) into ``engine``'s slices, each rank reading
    only the element ranges it keeps; buffers whole. Collective (the slices are published)."""
    module = engine.module
    with open_pretrained(path) as source:
        match = match_keys(source, expected_shapes(module), strict, alias_groups(module), str(source.path))
        sources = {name: (source, source_name) for name, source_name in match.sources.items()}
        engine.before_load()
        load_pretrained(module, engine.flat_params, Pretrained(sources), engine.place.rank)
    engine.after_load()
