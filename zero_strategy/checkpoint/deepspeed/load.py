"""Resuming a ZeRO engine from a DeepSpeed checkpoint, at any world size and stage: the checks, the param groups,
the buffers and the trainer state; the tensors load through checkpoint/sharded/load.py like our own format (each
rank reads only the partition pieces that overlap its ranges).

Every check runs before the first tensor is written, so a checkpoint that does not fit leaves the model and the
optimizers as they were.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.base.loadable import LoadTarget
from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zero_strategy.checkpoint.deepspeed.universal import open_deepspeed
from zero_strategy.checkpoint.sharded.load import load_optimizer_state, load_weights

LISTED = 5  # names listed per kind of problem in an error message
OPTIMIZER_STATES = {
    ("Adam", "AdamW"): {"exp_avg", "exp_avg_sq", "step"},
    ("SGD",): {"momentum_buffer"},
}
"""The optimizers whose state a DeepSpeed checkpoint's inner (torch) optimizer state maps onto, by class name, and
the state names each stores (Adam's ``amsgrad`` adds ``max_exp_avg_sq``)."""


def check_deepspeed_compatible(
    engine: LoadTarget, ckpt: DeepSpeedCheckpoint, strict: bool, with_optimizer: bool,
    renamed: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`CheckpointError` if ``ckpt`` does not describe this model (and, with ``with_optimizer``, its
    optimizer: one of :data:`OPTIMIZER_STATES`, with the same param groups). ``renamed``: the model's name of each
    checkpoint parameter it loads (name -> name in the checkpoint), when Lightning's load hooks renamed them."""
    model = {n: tuple(p.shape) for flat in engine.flat_params for n, p in zip(flat.names, flat.params, strict=True)}
    params = ckpt.params if renamed is None else {n: ckpt.params[s] for n, s in renamed.items() if s in ckpt.params}
    stored = {name: tuple(param.shape) for name, (_, param) in params.items()}
    keys = {key for key, value in engine.module.state_dict(keep_vars=True).items() if isinstance(value, Tensor)}
    wrong = [f"{n}: checkpoint {stored[n]} vs model {s}" for n, s in model.items() if stored.get(n, s) != s]
    missing = sorted(set(model) - set(stored))
    unexpected = sorted(set(stored) - keys)
    if wrong or (strict and (missing or unexpected)):
        problems = [
            f"shape mismatch {wrong[:LISTED]}" if wrong else "",
            f"missing parameters {missing[:LISTED]}" if missing and strict else "",
            f"unexpected parameters {unexpected[:LISTED]}" if unexpected and strict else "",
        ]
        raise CheckpointError(f"{ckpt.path} is a checkpoint of another model: " + "; ".join(p for p in problems if p))
    if with_optimizer:
        _check_optimizer(engine, ckpt)
        param_groups_for(engine, ckpt, renamed)


def _check_optimizer(engine: LoadTarget, ckpt: DeepSpeedCheckpoint) -> None:
    if len(engine.optimizers) != 1:
        raise CheckpointError(
            f"{ckpt.path}: a DeepSpeed checkpoint holds one optimizer's state; this run has "
            f"{len(engine.optimizers)} optimizers"
        )
    found = ckpt.stored_state_names()
    kind = type(engine.optimizers[0]).__name__
    for classes, names in OPTIMIZER_STATES.items():
        if found - {"max_exp_avg_sq"} == names and kind in classes:
            return
    supported = "; ".join(f"{'/'.join(c)} ({', '.join(sorted(n))})" for c, n in OPTIMIZER_STATES.items())
    raise CheckpointError(
        f"{ckpt.path}: its optimizer state holds {sorted(found)}, which cannot be mapped onto this run's {kind}. "
        f"Supported: {supported}, the same optimizer class as the DeepSpeed run's"
    )


def param_groups_for(
    engine: LoadTarget, ckpt: DeepSpeedCheckpoint, renamed: Mapping[str, str] | None = None
) -> list[list[dict[str, Any]]]:
    """Each of the engine's param groups' hyper-parameters (learning rates moved by schedulers), from the stored
    group that holds its parameters (matched by parameter names, not by position; ``renamed`` as for
    :func:`check_deepspeed_compatible`)."""
    members: dict[int, list[str]] = {}
    for _, flat, optimizers in engine.named_flat_params():
        if 0 in optimizers:
            for name, group in zip(flat.names, flat.param_group_in(0), strict=True):
                members.setdefault(group, []).append(name)
    group_of: dict[str, int] = {}
    stored = ckpt.param_groups()
    for index, (_, names) in enumerate(stored):
        if renamed is not None:
            names = [name for name, source in renamed.items() if source in set(names)]
        group_of.update(dict.fromkeys(names, index))
    groups: list[dict[str, Any]] = []
    for group_index in range(len(engine.optimizers[0].param_groups)):
        names = members.get(group_index, [])
        found = sorted({group_of[name] for name in names if name in group_of})
        if names and len(found) != 1:
            what = "none of DeepSpeed's param groups holds them" if not found else f"DeepSpeed's groups {found} do"
            raise CheckpointError(
                f"{ckpt.path}: param group {group_index} of this run holds {names[:LISTED]}, and {what}; group the "
                "parameters as the DeepSpeed run did"
            )
        groups.append(dict(stored[found[0]][0]) if found else {})
    return [groups]


def deepspeed_trainer_state(ckpt: DeepSpeedCheckpoint) -> dict[str, Any]:
    """Lightning's trainer state when Lightning's DeepSpeedStrategy wrote the checkpoint (its client state), with
    ``optimizer_states`` present (the optimizer state is read from the partitions); for a plain engine's checkpoint
    what DeepSpeed itself recorded: ``global_step`` and the LR scheduler's state under ``lr_schedulers``."""
    client = ckpt.client_state()
    if "pytorch-lightning_version" in client:
        return {**client, "optimizer_states": [{}]}
    state: dict[str, Any] = {"optimizer_states": [{}], "global_step": int(ckpt.model_states.get("global_steps", 0))}
    scheduler = ckpt.model_states.get("lr_scheduler")
    state["lr_schedulers"] = [scheduler] if scheduler else []
    state["deepspeed_client_state"] = client
    return state


def loss_scaler_state(ckpt: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    """DeepSpeed's fp16 dynamic loss scaler as our ``DynamicLossScaler.state_dict()`` (core/engine/loss_scaler.py),
    or None when the checkpoint has no dynamic scaler (fp32, bf16, a static scale).

    [Note: DeepSpeed's loss-scale window]
    DeepSpeed 0.19 doubles the scale when ``cur_iter - last_overflow_iter - 1`` is a positive multiple of the
    window; our scaler when ``iteration - last_overflow_iteration`` is a multiple of it: one iteration earlier.
    The overflow iteration is moved one step later in the translation, so the resumed run doubles when DeepSpeed's
    would have (the one exception: a checkpoint saved on the very step after an overflow doubles one step early).
    The scaler's knobs (window, hysteresis, minimum) are this run's configuration, not the checkpoint's."""
    fields = ckpt.loss_scaler()
    if not fields or not fields.get("dynamic", False) or "cur_scale" not in fields:
        return None
    return {
        "scale": float(fields["cur_scale"]),
        "hysteresis_left": int(fields.get("cur_hysteresis", 1)),
        "iteration": int(fields.get("cur_iter", 0)),
        "last_overflow_iteration": int(fields.get("last_overflow_iter", -1)) + 1,  # see the Note
        "skipped_steps": int(ckpt.model_states.get("skipped_steps", 0)),
    }


def deepspeed_buffers(ckpt: DeepSpeedCheckpoint) -> dict[str, Tensor]:
    """Every buffer the checkpoint holds, under its stored name (a load ignores names the module does not have,
    and Lightning's load hooks may rename them first)."""
    return ckpt.buffers()


def load_deepspeed(
    engine: LoadTarget, path: str | os.PathLike, with_optimizer: bool = True, strict: bool = True
) -> dict[str, Any]:
    """Load a DeepSpeed ZeRO checkpoint into ``engine`` (weights, buffers and, with ``with_optimizer``, optimizer
    state and param-group hyper-parameters) and return its trainer state (see :func:`deepspeed_trainer_state`;
    the caller restores LR schedulers from ``lr_schedulers``). Every rank calls it."""
    with open_deepspeed(path) as ckpt:
        check_deepspeed_compatible(engine, ckpt, strict, with_optimizer)
        groups = param_groups_for(engine, ckpt) if with_optimizer else None
        buffers = deepspeed_buffers(ckpt)
        state = deepspeed_trainer_state(ckpt)
        load_weights(engine, ckpt)
        engine.module.load_state_dict(buffers, strict=False)
        if groups is not None:
            load_optimizer_state(engine, ckpt, groups)
    return state
