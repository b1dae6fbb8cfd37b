"""Activation checkpointing: chosen submodules keep only their inputs for backward and recompute the rest.

Non-reentrant torch checkpointing wraps the module's *inner* forward, so the module's own hooks (stage 3's
gather/free) stay outside the checkpoint. In backward the unit is gathered again by its pre-backward hook before
the recomputation needs it, and units nested inside a checkpointed module gather themselves when the recomputation
calls them (see hooks.py); they are freed after their gradients are reduced, as in any backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CheckpointPolicy = Callable[[nn.Module], bool]
_ORIGINAL_FORWARD = "_zero_original_forward"


class ModuleClassPolicy:
    """Selects modules by class or class name (a class, not a closure, so a spawn launcher can pickle it)."""

    def __init__(self, classes: tuple[type[nn.Module], ...], names: frozenset[str]) -> None:
        self.classes = classes
        self.names = names

    def __call__(self, module: nn.Module) -> bool:
        kind = type(module)
        return isinstance(module, self.classes) or kind.__name__ in self.names or kind.__qualname__ in self.names


def make_policy(spec: Sequence[str | type[nn.Module]] | CheckpointPolicy | None) -> CheckpointPolicy | None:
    """Module classes, class names, or a callable ``module -> bool``; None or empty: no checkpointing."""
    if spec is None or (isinstance(spec, Sequence) and len(spec) == 0):
        return None
    if callable(spec) and not isinstance(spec, type):
        return spec
    items = [spec] if isinstance(spec, (str, type)) else list(spec)
    classes = tuple(item for item in items if isinstance(item, type))
    return ModuleClassPolicy(classes, frozenset(item for item in items if isinstance(item, str)))


def apply_activation_checkpointing(root: nn.Module, policy: CheckpointPolicy, offload_to_cpu: bool) -> int:
    """Wrap the forward of every outermost module the policy selects; returns how many were wrapped."""
    wrapped = 0
    skip_below: list[str] = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix + ".") for prefix in skip_below) or module is root:
            continue
        if policy(module) and not hasattr(module, _ORIGINAL_FORWARD):
            original = module.forward
            setattr(module, _ORIGINAL_FORWARD, original)
            module.forward = functools.partial(_checkpointed, original, offload_to_cpu)  # type: ignore[method-assign]
            skip_below.append(name)
            wrapped += 1
    return wrapped


def remove_activation_checkpointing(root: nn.Module) -> None:
    for module in root.modules():
        if hasattr(module, _ORIGINAL_FORWARD):
            del module.forward  # the instance attribute; the class's forward shows through again
            delattr(module, _ORIGINAL_FORWARD)


def _checkpointed(forward: Callable[..., Any], offload_to_cpu: bool, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward anyway
        return forward(*args, **kwargs)
    # cpu_checkpointing: the inputs the checkpoint keeps wait in (pinned) host memory instead of the GPU
    saved_on_cpu = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload_to_cpu else None
    with saved_on_cpu or nullcontext():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
