"""``zero-to-dcp`` from a DeepSpeed ZeRO checkpoint directory: its weights, buffers, optimizer state (per parameter,
as torch's ``get_optimizer_state_dict`` lays it out) and trainer state, in the same DCP key layout as our own
checkpoints (see [Note: DCP key layout] in checkpoint/dcp/content.py). Each parameter is one range read on
demand from the DeepSpeed partitions it spans, box by box, when DCP writes it."""

from __future__ import annotations

from typing import Any

import torch

from zero_strategy.checkpoint.dcp.content import (
    INFO,
    MODEL,
    OURS,
    TRAINER_STATE,
    add_range,
    info_json,
    optimizer_content,
    to_bytes,
)
from zero_strategy.checkpoint.dcp.planner import ChunkedTensor
from zero_strategy.checkpoint.deepspeed.load import deepspeed_trainer_state
from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zero_strategy.checkpoint.deepspeed.state_dict import state_dict_keys
from zero_strategy.checkpoint.sharded.shard_content import scalar_value

_PRECISIONS = (("fp16", "16-mixed"), ("bf16", "bf16-mixed"))  # DeepSpeed config section -> our precision name


def _whole(ckpt: DeepSpeedCheckpoint, name: str, tensor_of: str) -> ChunkedTensor:
    param = ckpt.params[name][1]
    tensor = ChunkedTensor(tuple(param.shape), torch.float32)

    def read(first: int, count: int) -> torch.Tensor:
        return ckpt.read_param(name, tensor_of, first, count)

    add_range(tensor, 0, param.numel, read)
    return tensor


def _precision(ckpt: DeepSpeedCheckpoint) -> str:
    config = ckpt.model_states.get("ds_config") or {}
    for section, name in _PRECISIONS:
        if (config.get(section) or {}).get("enabled", False):
            return name
    return "32-true"


def deepspeed_dcp_content(ckpt: DeepSpeedCheckpoint) -> dict[str, Any]:
    """The nested state dict DCP writes for ``ckpt``, every tensor a :class:`ChunkedTensor` read on demand."""
    weights: dict[str, ChunkedTensor] = {}
    model: dict[str, Any] = {}
    buffers = ckpt.buffers()
    for key in state_dict_keys(ckpt):
        if key.param is None:
            model[key.key] = buffers[key.key]
            continue
        if key.param not in weights:
            weights[key.param] = _whole(ckpt, key.param, "flat")
        model[key.key] = weights[key.param]
    states: dict[str, dict[str, Any]] = {}
    for name, (flat, _) in ckpt.params.items():
        names = [] if name in ckpt.aliases else ckpt.state_names(flat)
        if not names:  # a tied name, or a frozen parameter: no state of its own
            continue
        state: dict[str, Any] = {state_name: _whole(ckpt, name, f"optim:{state_name}") for state_name in names}
        scalars = ckpt.scalar_state_at(flat, 0)
        state.update({key: scalar_value(record, torch.device("cpu")) for key, record in scalars.items()})
        states[name] = state
    groups = [[{**hyper, "params": members} for hyper, members in ckpt.param_groups()]]
    content = {MODEL: model, **optimizer_content([states], groups, shared=False)}
    versions = {"deepspeed": str(ckpt.model_states.get("ds_version", "unknown"))}
    # no optimizer record: the class is not in a DeepSpeed checkpoint, so a resume does not compare it
    info = info_json(ckpt.world_size, ckpt.stage, _precision(ckpt), versions, [], {"converted_from": "deepspeed"})
    content[OURS] = {TRAINER_STATE: to_bytes(deepspeed_trainer_state(ckpt)), INFO: info}
    return content
