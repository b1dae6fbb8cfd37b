"""What a zero_strategy DCP checkpoint holds, and under which keys (shared by the offline export and the online save).

[Note: DCP key layout]
The state dict handed to ``torch.distributed.checkpoint.save`` is the one FSDP2 users write,
``{"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}`` (torch 2.13,
``torch/distributed/checkpoint/state_dict.py``), flattened by DCP into::

    model.<state_dict key>                       every key of the module's state_dict: parameters as their fp32
                                                 masters (tied parameters under each of their keys), buffers
    optim.state.<fqn>.<name>                     per-element optimizer state (exp_avg, exp_avg_sq, momentum_buffer),
                                                 the parameter's shape; <fqn> is the parameter's first name, as
                                                 torch's get_optimizer_state_dict uses (model.named_parameters())
    optim.state.<fqn>.step                       0-d tensors (and any other scalar state), per parameter
    optim.param_groups.<i>.<hyper-parameter>     each param group of every optimizer, in optimizer order, with
    optim.param_groups.<i>.params                the fqns of its parameters (torch maps groups by these)
    optim_<k>.state.<fqn>.<name>,                instead of optim.*, when some parameter is stepped by several
    optim_<k>.param_groups.<i>.*                 optimizers (torch's merged layout holds one state per fqn):
                                                 optimizer k's own state dict, as
                                                 get_optimizer_state_dict(model, optimizer_k) gives it
    zero_strategy.trainer_state                  bytes: torch.save of Lightning's trainer state (loops, callbacks,
                                                 schedulers, precision state) without state_dict and optimizer
                                                 state; load with torch.load(io.BytesIO(...), weights_only=True)
    zero_strategy.rng.<rank>                     bytes: each shard rank's RNG state (exact resume with dropout);
                                                 with tensor parallelism keyed by world rank
    zero_strategy.info                           str: JSON (world size, tensor-parallel size, stage, precision,
                                                 versions, optimizers)

Parameters and per-element optimizer state are written as boxes of each rank's flat slice (see boxes.py), so DCP's
metadata describes them as chunks that tile each tensor and any reader layout reshards by intersection.
Everything else is written once (by the lowest rank holding it). With tensor parallelism every tensor is recorded
at its whole (global) shape: see [Note: DCP boxes of a tensor-parallel block] in checkpoint/dcp/tensor_parallel.py.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.dcp.boxes import range_boxes
from zero_strategy.checkpoint.dcp.planner import ChunkedTensor, LazyChunk

if TYPE_CHECKING:
    from zero_strategy.checkpoint.dcp.tensor_parallel import Placed

MODEL = "model"
OPTIM = "optim"
STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"
OURS = "zero_strategy"
TRAINER_STATE = "trainer_state"
RNG = "rng"
INFO = "info"
FORMAT_NAME = "zero_strategy-dcp"
FORMAT_VERSION = 1


def add_range(
    tensor: ChunkedTensor, start: int, count: int, read: Callable[[int, int], Tensor], placed: Placed | None = None
) -> None:
    """Add the boxes of elements ``[start, start + count)`` of ``tensor`` (row-major), each read on demand with
    ``read(first element, number of elements)`` → a 1-D tensor of that many elements. With ``placed`` the range
    is one of this rank's tensor-parallel block, cut in the block and shifted to where the block sits (see [Note:
    DCP boxes of a tensor-parallel block] in checkpoint/dcp/tensor_parallel.py)."""
    shape, shift = (tensor.shape, (0,) * len(tensor.shape)) if placed is None else (placed.block, placed.offsets)
    for box in range_boxes(shape, start, count):
        values = partial(_box_values, read, start + box.range_start, box.numel, box.sizes)
        offsets = tuple(offset + by for offset, by in zip(box.offsets, shift, strict=True))
        tensor.chunks.append(LazyChunk(offsets, box.sizes, values))


def _box_values(read: Callable[[int, int], Tensor], first: int, numel: int, sizes: tuple[int, ...]) -> Tensor:
    return read(first, numel).reshape(sizes)


def to_bytes(value: Any) -> bytes:
    """``torch.save`` of ``value`` as bytes: stored as one DCP item whatever nesting ``value`` has (DCP would
    otherwise flatten a nested dict into one item per leaf)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(blob: bytes, weights_only: bool = True) -> Any:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only)


def rng_record(tensors: dict[str, Tensor], plain_json: str) -> bytes:
    """One rank's RNG state (as :func:`zero_strategy.checkpoint.base.rng.capture_rng` returns it), as bytes."""
    return to_bytes({"tensors": tensors, "plain": plain_json})


def info_json(
    world_size: int, stage: int, precision: str, versions: dict[str, str], optimizers: list[dict[str, Any]],
    extra: dict[str, Any], tensor_parallel_size: int = 1,
) -> str:  # fmt: skip
    return json.dumps(
        {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "world_size": world_size,
            "tensor_parallel_size": tensor_parallel_size,  # world rank d·K + t: DP coordinate d, TP coordinate t
            "stage": stage,
            "precision": precision,
            "versions": versions,
            "optimizers": optimizers,
            "extra": extra,
        }
    )


def param_group_entries(
    hyper_parameters: list[list[dict[str, Any]]], members: dict[tuple[int, int], list[str]]
) -> list[list[dict[str, Any]]]:
    """Per optimizer, its param groups in order, each its hyper-parameters (``params`` excluded) plus ``params``,
    the fqns ``members[(optimizer, group)]``."""
    optimizers: list[list[dict[str, Any]]] = []
    for optimizer_index, optimizer_groups in enumerate(hyper_parameters):
        groups = []
        for group_index, group in enumerate(optimizer_groups):
            entry = {key: value for key, value in group.items() if key != PARAMS}
            entry[PARAMS] = list(members.get((optimizer_index, group_index), []))
            groups.append(entry)
        optimizers.append(groups)
    return optimizers


def optimizer_content(
    states: list[dict[str, dict[str, Any]]], groups: list[list[dict[str, Any]]] | None, shared: bool
) -> dict[str, Any]:
    """The optimizers' part of the state dict (see [Note: DCP key layout]): ``states[i]`` is optimizer ``i``'s
    state by parameter fqn, ``groups[i]`` its param groups (None: another rank writes them). ``shared``: some
    parameter is stepped by several optimizers, which torch's merged layout cannot hold (one state per fqn)."""
    if not shared:
        merged: dict[str, dict[str, Any]] = {}
        for state in states:
            merged.update(state)
        part: dict[str, Any] = {STATE: merged}
        if groups is not None:
            part[PARAM_GROUPS] = [group for optimizer_groups in groups for group in optimizer_groups]
        return {OPTIM: part}
    content: dict[str, Any] = {}
    for index, state in enumerate(states):
        own: dict[str, Any] = {STATE: state}
        if groups is not None:
            own[PARAM_GROUPS] = groups[index]
        content[f"{OPTIM}_{index}"] = own
    return content
