"""torch's fused optimizer kernels switched on for the duration of each step, where they are exact on master
slices (see [Note: fused optimizer steps])."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from zero_strategy.core.engine.optimizer import qualified_name

# [Note: fused optimizer steps]
# A master piece is one contiguous 1-D fp32 tensor per unit: the ideal input for torch's fused kernels (one pass
# over memory instead of one pass per arithmetic operation). torch picks them only when asked (``fused=None``, its
# default, means the per-tensor loop on CPU and foreach on CUDA). The choice is read from ``group["fused"]`` at step
# time, so ZeRO asks for the fused kernel *for the duration of each step*: a step pre-hook sets ``fused=True`` on
# the groups where it is exact, the post-hook puts the user's ``None`` back. The user's optimizer object, its class
# and every hyper-parameter stay theirs, and ``state_dict()`` and checkpoints (written between steps) record the
# user's own settings, so a checkpoint does not depend on the ``fused_optimizer`` option.
# - Only ``fused=None`` *and* ``foreach=None`` is ours to choose: an explicit ``fused=False`` / ``foreach=...``
#   (torch's documented way to force an implementation) and an explicit ``fused=True`` are left alone.
# - The kernels exist in torch 2.13 for Adam, AdamW, SGD and Adagrad (the optimizers with a ``fused`` argument),
#   on CPU and CUDA; exact classes only (a subclass may override ``step``).
# - Not with ``differentiable`` (fused refuses it) or ``capturable`` (CUDA-graph steps: the user chose that path).
# - fp32 / fp64 pieces only: with bf16/fp16 parameters the kernels compute in fp32 internally, which is more than
#   rounding away from the per-op low-precision loop. Masters are fp32 whenever a precision plugin is used.
# - Fused SGD with momentum needs every stepped piece's momentum buffer to exist, or none (its "first step"); a
#   piece stepped for the first time later (it had no gradient before: see unused.py) makes that step run the
#   default loop, which creates the buffer.
# - Fused steps keep ``state["step"]`` on the parameter's device (torch's own rule for fused); a step tensor made
#   elsewhere (Adagrad creates state at construction, on the CPU) is moved there first.
# The result agrees with the default loop to fp32 rounding (a few ulps after many steps; measured in
# tests/unit/test_fused_steps.py), not bit for bit: the kernel orders its arithmetic differently.
FUSED_OPTIMIZERS: frozenset[str] = frozenset(
    {"torch.optim.adam.Adam", "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD", "torch.optim.adagrad.Adagrad"}
)
_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64)


@dataclass(slots=True)
class _FusedBinding:
    handles: list[RemovableHandle]
    flipped: list[int] = field(default_factory=list)  # groups set to fused=True for the step in progress


_FUSED_BINDINGS: weakref.WeakKeyDictionary[Optimizer, _FusedBinding] = weakref.WeakKeyDictionary()


def fused_step_possible(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s class has a fused kernel ZeRO may switch on (see [Note: fused optimizer steps])."""
    return qualified_name(optimizer) in FUSED_OPTIMIZERS


def _ours_to_choose(group: dict[str, Any]) -> bool:
    return (
        group.get("fused") is None
        and group.get("foreach") is None
        and not group.get("differentiable", False)
        and not group.get("capturable", False)
    )


def _fused_exact_for(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    """Every piece this step updates is a dense fp32/fp64 tensor on a device with fused kernels, and (SGD with
    momentum) the momentum buffers exist for all of them or for none."""
    stepped = [p for p in group["params"] if p.grad is not None]
    for piece in stepped:
        grad = piece.grad
        assert grad is not None
        if piece.dtype not in _FUSED_DTYPES or piece.device.type not in _FUSED_DEVICES:
            return False
        if grad.is_sparse or grad.dtype != piece.dtype or grad.device != piece.device:
            return False
    if isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) != 0:
        buffers = [optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in stepped]
        return all(buffers) or not any(buffers)
    return True


def _step_state_to_device(optimizer: Optimizer, group: dict[str, Any]) -> None:
    for piece in group["params"]:
        step = optimizer.state.get(piece, {}).get("step")
        if isinstance(step, Tensor) and (step.device != piece.device or step.dtype != torch.float32):
            optimizer.state[piece]["step"] = step.to(device=piece.device, dtype=torch.float32)


def _restore_user_choice(optimizer: Optimizer, binding: _FusedBinding) -> None:
    for index in binding.flipped:
        optimizer.param_groups[index]["fused"] = None
    binding.flipped.clear()


def _before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    binding = _FUSED_BINDINGS.get(optimizer)
    if binding is None:
        return
    _restore_user_choice(optimizer, binding)  # a step that raised left its groups flipped
    for index, group in enumerate(optimizer.param_groups):
        if _ours_to_choose(group) and _fused_exact_for(optimizer, group):
            _step_state_to_device(optimizer, group)
            group["fused"] = True
            binding.flipped.append(index)


def _after_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    binding = _FUSED_BINDINGS.get(optimizer)
    if binding is not None:
        _restore_user_choice(optimizer, binding)


def install_fused_steps(optimizer: Optimizer, enabled: bool) -> None:
    """Step ``optimizer`` with torch's fused kernel wherever that is exact (see [Note: fused optimizer steps]).
    Nothing happens when ``enabled`` is False or the class has no fused kernel. Idempotent."""
    remove_fused_steps(optimizer)
    if not enabled or not fused_step_possible(optimizer):
        return
    handles = [optimizer.register_step_pre_hook(_before_step), optimizer.register_step_post_hook(_after_step)]
    _FUSED_BINDINGS[optimizer] = _FusedBinding(handles)


def remove_fused_steps(optimizer: Optimizer) -> None:
    """Undo :func:`install_fused_steps`: the optimizer steps with torch's default choice again. Idempotent."""
    binding = _FUSED_BINDINGS.pop(optimizer, None)
    if binding is None:
        return
    _restore_user_choice(optimizer, binding)
    for handle in binding.handles:
        handle.remove()
