"""Resuming a ZeRO engine from a ``torch.distributed.checkpoint`` directory (ours, or FSDP2's / Lightning's /
torchtitan's), at any world size and stage: the checks, the param groups and the buffers; the tensors load through
checkpoint/sharded/load.py like our own format, each rank reading only the stored chunks that overlap its ranges.

Every check runs before the first tensor is written, so a checkpoint that does not fit leaves the model and the
optimizers as they were.
"""

from __future__ import annotations

import os
from typing import Any

from torch import Tensor, nn

from zero_strategy.checkpoint.base.format import NO_OPTIMIZER_STATE_KEY, CheckpointError
from zero_strategy.checkpoint.base.loadable import LoadTarget
from zero_strategy.checkpoint.dcp.reader import DcpCheckpoint
from zero_strategy.checkpoint.sharded.load import load_optimizer_state, load_weights
from zero_strategy.core.engine.optimizer import qualified_name

LISTED = 5  # names listed per kind of problem in an error message


def module_keys(module: nn.Module) -> list[str]:
    """The module's state_dict keys that hold tensors (what a DCP checkpoint of it stores under ``model.``)."""
    return [key for key, value in module.state_dict(keep_vars=True).items() if isinstance(value, Tensor)]


def check_dcp_compatible(engine: LoadTarget, ckpt: DcpCheckpoint, strict: bool, with_optimizer: bool) -> None:
    """Raise :class:`CheckpointError` if ``ckpt`` does not describe this model (and, with ``with_optimizer``, its
    optimizers' parameter groups)."""
    model = {n: tuple(p.shape) for flat in engine.flat_params for n, p in zip(flat.names, flat.params, strict=True)}
    stored = {name: tuple(param.shape) for name, (_, param) in ckpt.params.items()}
    keys = set(module_keys(engine.module))
    wrong = [f"{n}: checkpoint {stored[n]} vs model {s}" for n, s in model.items() if stored.get(n, s) != s]
    missing = sorted(set(model) - set(stored))
    unexpected = sorted(set(stored) - keys)
    if wrong or (strict and (missing or unexpected)) or not stored:
        problems = [
            f"shape mismatch {wrong[:LISTED]}" if wrong else "",
            f"missing parameters {missing[:LISTED]}" if missing and strict else "",
            f"unexpected tensors {unexpected[:LISTED]}" if unexpected and strict else "",
            "no model tensors found (looked under 'model.', 'state_dict.' and the top level)" if not stored else "",
        ]
        raise CheckpointError(f"{ckpt.path} is a checkpoint of another model: " + "; ".join(p for p in problems if p))
    if not with_optimizer:
        return
    info = ckpt.info
    if not ckpt.has_optimizer_state:
        why = (info or {}).get("extra", {}).get(NO_OPTIMIZER_STATE_KEY, "saved without it")
        raise CheckpointError(
            f"{ckpt.path} holds no optimizer state ({why}), so a fit cannot resume from it. To start a new fit from "
            f"its weights, pass pretrained={str(ckpt.path)!r} (ZeroStrategy) and fit without ckpt_path."
        )
    current = [{"class": qualified_name(o), "param_groups": len(o.param_groups)} for o in engine.optimizers]
    if info is not None and info.get("optimizers") and info["optimizers"] != current:
        raise CheckpointError(f"{ckpt.path}: optimizers differ: checkpoint {info['optimizers']}, this run {current}")
    param_groups_for(engine, ckpt)


def param_groups_for(engine: LoadTarget, ckpt: DcpCheckpoint) -> list[list[dict[str, Any]]]:
    """Each of the engine's param groups' hyper-parameters (learning rates moved by schedulers), from the stored
    group of the same optimizer that holds its parameters (torch matches groups by parameter names too, not by
    position)."""
    members: dict[tuple[int, int], list[str]] = {}
    for _, flat, optimizers in engine.named_flat_params():
        for opt_index in optimizers:
            for name, group in zip(flat.names, flat.param_group_in(opt_index), strict=True):
                members.setdefault((opt_index, group), []).append(name)
    result: list[list[dict[str, Any]]] = []
    for opt_index, optimizer in enumerate(engine.optimizers):
        group_of = {fqn: hyper for hyper, fqns in ckpt.param_groups(opt_index) for fqn in fqns}
        groups = []
        for group_index in range(len(optimizer.param_groups)):
            names = members.get((opt_index, group_index), [])
            found = [group_of[name] for name in names if name in group_of]
            if names and not found:
                raise CheckpointError(
                    f"{ckpt.path}: no stored param group holds the parameters of group {group_index} of optimizer "
                    f"{opt_index} ({names[:LISTED]})"
                )
            if any(_differ(other, found[0]) for other in found[1:]):
                raise CheckpointError(
                    f"{ckpt.path}: the parameters of group {group_index} of optimizer {opt_index} belong to stored "
                    f"groups with different hyper-parameters; this run groups its parameters differently"
                )
            groups.append(dict(found[0]) if found else {})
        result.append(groups)
    return result


def _differ(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() != b.keys() or any(repr(a[key]) != repr(b[key]) for key in a)


def dcp_buffers(module: nn.Module, ckpt: DcpCheckpoint) -> dict[str, Tensor]:
    """The module's buffers (non-parameter tensors of its state_dict) that the checkpoint holds, read whole."""
    params = {id(p) for p in module.parameters()}
    buffers: dict[str, Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor) and id(value) not in params and key in ckpt.keys.model:
            buffers[key] = ckpt.read_tensor(ckpt.keys.model[key], 0, value.numel()).view(value.shape)
    return buffers


def load_dcp(
    engine: LoadTarget,
    path: str | os.PathLike,
    with_optimizer: bool = True,
    strict: bool = True,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Load a DCP checkpoint into ``engine`` (weights, buffers and, with ``with_optimizer``, optimizer state and
    param-group hyper-parameters) and return its trainer state. Every rank calls it (at stage 3 on one host the
    ranks meet at the barriers around writing the host-wide parameters; nothing else is exchanged)."""
    with DcpCheckpoint(path, expected=module_keys(engine.module)) as ckpt:
        check_dcp_compatible(engine, ckpt, strict, with_optimizer)
        groups = param_groups_for(engine, ckpt) if with_optimizer else None
        buffers = dcp_buffers(engine.module, ckpt)
        state = ckpt.trainer_state(weights_only)
        load_weights(engine, ckpt)
        engine.module.load_state_dict(buffers, strict=False)
        if groups is not None:
            load_optimizer_state(engine, ckpt, groups)
    return state
