"""Whole (consolidated) state dicts of a sharded engine, and loading them back into the slices.

[Note: the consolidated Fabric file]
``fabric.save`` writes one file when asked (``state_dict_type="full"``, or a ``filter`` on a module or optimizer,
which selects by name and so needs whole tensors): ``torch.save`` on rank 0 of ``{key: value}`` where a module's
value is its ``state_dict()`` with fp32 parameters (the masters, not the compute-dtype copies; buffers in their
dtype; tied parameters under each key) and an optimizer's value is FSDP's "full optimizer state dict" layout:
``{"state": {parameter name: {"exp_avg": whole tensor, ..., "step": tensor}}, "param_groups": [{hyper-parameters,
"params": [parameter names]}]}``, names being the module's first name for each parameter. It is gathered unit by
unit (one FlatParam's slices at a time, every rank taking part); only rank 0 keeps the values, so rank 0 ends with
the whole model and optimizer state, the others with one unit at a time. A plain litgpt ``GPT`` loads the
``"model"`` entry with ``load_state_dict``. Loading it back reads the file memory-mapped on every rank, and each
rank copies only the element ranges it keeps, at any world size and stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.checkpoint.base.loadable import LoadTarget
from zero_strategy.core.engine.optimizer import carry_state_over
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.whole import gather_whole, param_views

Keep = Callable[[str, Any], bool]  # Fabric's filter: (key, value) -> keep


class WholeStateSource(LoadTarget, Protocol):
    """An engine whose whole state is gathered or loaded: a :class:`LoadTarget` that also finds an optimizer's
    position and master pieces (the engine satisfies it structurally)."""

    def optimizer_index(self, optimizer: Optimizer) -> int: ...

    def master_params(self, optimizer: Optimizer) -> list[nn.Parameter]: ...


def full_weights(engine: WholeStateSource, keep: Keep | None = None) -> dict[str, Tensor]:
    """The module's state dict with fp32 (master) parameters, on rank 0 (``keep``: which keys to write); the other
    ranks return ``{}``. Collective: every rank calls it."""
    leader = engine.comms.everyone.rank == 0
    names = engine.parameter_names()
    by_name: dict[str, Tensor] = {}
    for flat in engine.flat_params:
        whole = gather_whole(flat, flat.shard, f"full state dict of {flat.label}")
        if leader:
            for name, values in param_views(flat, whole):
                by_name[name] = values.cpu().clone()
        del whole
    if not leader:
        return {}
    out: dict[str, Tensor] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in names:
            value = by_name[names[id(value)]]
        elif isinstance(value, Tensor):
            value = value.detach().cpu().clone()
        if keep is None or keep(key, value):
            out[key] = value
    return out


def full_optimizer_state(engine: WholeStateSource, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s whole state, keyed by parameter name (see [Note: the consolidated Fabric file]), on rank 0;
    ``{}`` on the others. Collective."""
    index = engine.optimizer_index(optimizer)
    leader = engine.comms.everyone.rank == 0
    state: dict[str, dict[str, Any]] = {}
    members: dict[int, list[str]] = {}
    for flat in engine.flat_params:
        if index not in flat.optimizers:
            continue
        for name, group in zip(flat.names, flat.param_group_in(index), strict=True):
            members.setdefault(group, []).append(name)
        names, records = _local_state(flat, optimizer)
        gathered = flat.comm.all_gather_object((names, records), f"optimizer state names of {flat.label}")
        every_name = sorted({(n, str(d)) for rank_names, _ in gathered for n, d in rank_names})
        for name, dtype_name in every_name:
            aligned = _aligned(flat, optimizer, name, getattr(torch, dtype_name.removeprefix("torch.")))
            whole = gather_whole(flat, aligned, f"optimizer state {name} of {flat.label}")
            if leader:
                for param_name, values in param_views(flat, whole):
                    state.setdefault(param_name, {})[name] = values.cpu()
        if leader:
            shard_numel = flat.layout.shard_numel
            for span in flat.layout.spans:
                state.setdefault(span.name, {}).update(_scalars_at(gathered, span.offset, shard_numel))
    if not leader:
        return {}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": members.get(position, [])}
        for position, group in enumerate(optimizer.param_groups)
    ]
    return {"state": state, "param_groups": groups}


def _local_state(flat: FlatParam, optimizer: Optimizer) -> tuple[list[tuple[str, str]], list[tuple]]:
    """(element-wise state names with dtypes, per-piece (offset, numel, scalar state)) of this rank's pieces."""
    names: dict[str, str] = {}
    records = []
    for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
        piece_state = optimizer.state.get(piece, {})
        scalars = {}
        for name, value in piece_state.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape == piece.shape:
                names.setdefault(name, str(value.dtype))
            else:
                scalars[name] = value.detach().cpu().clone() if isinstance(value, Tensor) else value
        records.append((offset, piece.numel(), scalars))
    return sorted(names.items()), records


def _aligned(flat: FlatParam, optimizer: Optimizer, name: str, dtype: torch.dtype) -> Tensor:
    """This rank's state ``name`` laid out like its shard (zeros where a piece has none)."""
    aligned = torch.zeros(flat.shard.numel(), dtype=dtype, device=flat.shard.device)
    for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
        value = optimizer.state.get(piece, {}).get(name)
        if value is not None:
            aligned[offset : offset + piece.numel()].copy_(value.detach().reshape(-1))
    return aligned


def _scalars_at(gathered: list[tuple], position: int, shard_numel: int) -> dict[str, Any]:
    """The scalar state (``step``) of the piece holding element ``position`` of the flat buffer."""
    rank, local = divmod(position, shard_numel)
    if rank >= len(gathered):
        return {}
    for offset, numel, scalars in gathered[rank][1]:
        if offset <= local < offset + numel:
            return dict(scalars)
    return {}


def load_full_optimizer_state(engine: WholeStateSource, optimizer: Optimizer, saved: dict[str, Any]) -> None:
    """Give ``optimizer``'s master pieces the slices of a whole optimizer state keyed by parameter name (see [Note:
    the consolidated Fabric file]), and its groups the saved hyper-parameters. Local: each rank keeps its ranges."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or "param_groups" not in saved:
        raise ValueError(
            "expected a whole optimizer state keyed by parameter name ({'state': {name: {...}}, 'param_groups': "
            "[...]}), as ZeRO's consolidated file and FSDP's full optimizer state dict hold; a torch optimizer "
            "state_dict keyed by parameter index cannot be matched to ZeRO's slices."
        )
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer state has {len(groups)} param groups, this optimizer "
                         f"{len(optimizer.param_groups)}")
    for group, stored in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in stored.items() if k != "params"})
    params = {name: param for flat in engine.flat_params for name, param in zip(flat.names, flat.params, strict=True)}
    existing = {params[name]: dict(value) for name, value in saved["state"].items() if name in params}
    index = engine.optimizer_index(optimizer)
    for piece in engine.master_params(optimizer):
        optimizer.state.pop(piece, None)  # a load replaces the state; a piece the file has none for starts fresh
    for flat in engine.flat_params:
        if index in flat.optimizers:
            carry_state_over(optimizer, flat, existing)
    for piece_state in optimizer.state.values():
        step = piece_state.get("step")
        if isinstance(step, Tensor):  # torch keeps a non-capturable, non-fused step counter on the host
            piece_state["step"] = step.to("cpu", torch.float32)
