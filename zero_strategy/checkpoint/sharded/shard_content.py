"""What one rank's shard file holds: its master slices, its optimizer-state slices and its RNG state.

Per-element optimizer state (``exp_avg``, ``momentum_buffer``, ...) is stored shard-aligned — one tensor of the
shard's length per FlatParam, optimizer and state name (a FlatParam two optimizers step has two of each) — so a
reader finds any parameter's state at the same offsets as its weights. Per-piece scalars (Adam's ``step``) go to
the file's JSON metadata with the piece and the optimizer they belong to (see [Note: format versions] in
checkpoint/base/format.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import state_name
from zero_strategy.checkpoint.base.writable import WritableFlat, WritableSource

TensorSpec = tuple[str, torch.dtype, list[int]]


def weight_name(key: str) -> str:
    return f"flat/{key}"


def _is_elementwise(value: object, piece: Tensor) -> bool:
    return isinstance(value, Tensor) and value.shape == piece.shape and value.dim() > 0


def _scalar_record(value: object) -> dict[str, Any]:
    if isinstance(value, Tensor):
        return {"value": value.item(), "tensor": True, "dtype": str(value.dtype).removeprefix("torch.")}
    return {"value": value, "tensor": False}


def scalar_value(record: dict[str, Any], device: torch.device) -> object:
    if record["tensor"]:
        return torch.tensor(record["value"], dtype=getattr(torch, record["dtype"]), device=device)
    return record["value"]


def collect_shard(
    engine: WritableSource, with_optimizer: bool
) -> tuple[list[TensorSpec], Iterator[Tensor], dict[str, list[dict[str, Any]]]]:
    """(tensor specs, a generator yielding the tensors in that order, per-piece scalar state)."""
    specs: list[TensorSpec] = []
    # (flat, state name or None for the weights, dtype, the optimizer's state dict)
    producers: list[tuple[WritableFlat, str | None, torch.dtype, dict]] = []
    scalars: dict[str, list[dict[str, Any]]] = {}
    for key, flat, optimizers in engine.named_flat_params():
        specs.append((weight_name(key), flat.shard.dtype, [flat.shard.numel()]))
        producers.append((flat, None, flat.shard.dtype, {}))
        if not with_optimizer:
            continue
        records: list[dict[str, Any]] = []
        for opt_index in optimizers:
            state = engine.optimizers[opt_index].state
            names: dict[str, torch.dtype] = {}
            groups = flat.piece_group_in(opt_index)
            for piece, offset, group in zip(flat.master_pieces, flat.piece_offset, groups, strict=True):
                piece_state = state.get(piece, {})
                for name, value in piece_state.items():
                    if _is_elementwise(value, piece):
                        names.setdefault(name, value.dtype)
                record_state = {n: _scalar_record(v) for n, v in piece_state.items() if not _is_elementwise(v, piece)}
                records.append({"offset": offset, "numel": piece.numel(), "optimizer": opt_index, "group": group,
                                "state": record_state})
            for name, dtype in sorted(names.items()):
                specs.append((state_name(key, opt_index, name), dtype, [flat.shard.numel()]))
                producers.append((flat, name, dtype, state))
        if optimizers:
            scalars[key] = records

    def produce() -> Iterator[Tensor]:
        # One shard-sized tensor alive at a time: memory stays near one slice, not the whole optimizer state.
        for flat, name, dtype, state in producers:
            if name is None:
                yield flat.shard
                continue
            aligned = torch.zeros(flat.shard.numel(), dtype=dtype)
            for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
                value = state.get(piece, {}).get(name)
                if value is not None:
                    aligned[offset : offset + piece.numel()].copy_(value.detach().reshape(-1))
            yield aligned

    return specs, produce(), scalars


def encode_metadata(checkpoint_id: str, rank: int, world_size: int, scalars: dict, rng_json: str) -> dict[str, str]:
    return {
        "checkpoint_id": checkpoint_id,
        "rank": str(rank),
        "world_size": str(world_size),
        "scalars": json.dumps(scalars),
        "rng": rng_json,
    }
