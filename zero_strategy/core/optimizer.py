"""Binding the user's optimizers to master slices: which optimizers are exact on slices, and the re-pointing.

[Note: why only element-wise optimizers]
ZeRO hands each optimizer a 1-D slice that starts and ends anywhere inside a parameter. An optimizer whose update
of one element depends only on that element's gradient history (SGD, Adam, ...) computes exactly what it would
on whole tensors. One that looks at whole tensors (LAMB's per-tensor trust ratio, Adafactor's row/column
statistics, Shampoo, Muon, LBFGS's line search over all parameters) would be silently wrong, so it is refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.core.class_patch import override_method, restore_class

ELEMENTWISE_OPTIMIZERS: frozenset[str] = frozenset(
    {
        "torch.optim.sgd.SGD",
        "torch.optim.adam.Adam",
        "torch.optim.adamw.AdamW",
        "torch.optim.adagrad.Adagrad",
        "torch.optim.rmsprop.RMSprop",
        "torch.optim.adadelta.Adadelta",
        "torch.optim.adamax.Adamax",
        "torch.optim.nadam.NAdam",
        "torch.optim.radam.RAdam",
        "torch.optim.asgd.ASGD",
        "torch.optim.rprop.Rprop",
    }
)


class UnsupportedOptimizerError(TypeError):
    """The optimizer cannot be run exactly on flat slices."""


def qualified_name(optimizer: Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_optimizer(optimizer: Optimizer, allow_untested: bool) -> None:
    """Refuse optimizers that are not known to be element-wise (see [Note: why only element-wise optimizers])."""
    name = qualified_name(optimizer)
    if name in ELEMENTWISE_OPTIMIZERS or allow_untested:
        return
    if name == "torch.optim.lbfgs.LBFGS":
        why = "LBFGS runs a line search over all parameters as one vector and re-evaluates the closure"
    elif name == "torch.optim.sparse_adam.SparseAdam":
        why = "SparseAdam needs sparse gradients of whole embedding tables"
    else:
        why = "it is not on the list of element-wise optimizers known to be exact on flat slices"
    raise UnsupportedOptimizerError(
        f"ZeRO cannot shard optimizer {name}: {why}. ZeRO gives each rank a 1-D slice that cuts through "
        "parameters, so only optimizers whose update of an element depends on that element alone are exact "
        f"({', '.join(sorted(n.rsplit('.', 1)[1] for n in ELEMENTWISE_OPTIMIZERS))}). If your optimizer is "
        "element-wise, pass allow_untested_optimizer=True to ZeroStrategy."
    )


def param_group_index(optimizers: list[Optimizer]) -> dict[int, tuple[int, int]]:
    """``id(param)`` → (optimizer index, param group index), refusing a parameter claimed twice."""
    owner: dict[int, tuple[int, int]] = {}
    for opt_index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) in owner:
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} appears twice in the optimizers' param groups "
                        f"(optimizer {owner[id(param)][0]} group {owner[id(param)][1]} and optimizer {opt_index} "
                        f"group {group_index}); ZeRO needs each parameter in exactly one group."
                    )
                owner[id(param)] = (opt_index, group_index)
    return owner


def repoint_param_groups(optimizer: Optimizer, pieces_by_group: dict[int, list[nn.Parameter]]) -> None:
    """Make the optimizer step the master pieces instead of the module's parameters.

    The optimizer object itself, its groups and their hyper-parameters are kept: LR schedulers hold references.
    """
    for group_index, group in enumerate(optimizer.param_groups):
        group["params"] = list(pieces_by_group.get(group_index, []))


def carve_state(param_state: dict[str, Any], param: Tensor, start: int, count: int) -> dict[str, Any]:
    """The part of one parameter's optimizer state that covers its elements ``[start, start+count)``: element-wise
    tensors are sliced (flattened), scalars (``step``) copied. Adagrad, for one, creates state at construction."""
    carved: dict[str, Any] = {}
    for key, value in param_state.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape == param.shape:
            carved[key] = value.detach().reshape(-1)[start : start + count]
        else:
            carved[key] = value.clone() if isinstance(value, Tensor) else value
    return carved


# [Note: zero_grad reaches the module's gradients]
# The user's optimizer holds master slices, so its zero_grad() clears only their gradients. At stage 1 the module's
# own gradients wait until the step; a zero_grad() in between (manual optimization with several optimizers: G's
# backward also reached D's parameters) must clear those too, as it would under DDP. torch offers no zero_grad hook,
# and Lightning's LightningOptimizer calls the optimizer *class's* method, so the optimizer gets a subclass whose
# zero_grad also runs the engine's callback; release() restores the class.
_ZERO_GRAD_CALLBACKS: weakref.WeakKeyDictionary[Optimizer, Callable[[], None]] = weakref.WeakKeyDictionary()


def _zero_grad_with_callback(original: Any) -> Callable[..., None]:
    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        raw = getattr(self, "_optimizer", self)  # a LightningOptimizer wraps the real one
        original.zero_grad(raw, set_to_none=set_to_none)
        hook = _ZERO_GRAD_CALLBACKS.get(raw)
        if hook is not None:
            hook()

    return zero_grad


def install_zero_grad_hook(optimizer: Optimizer, callback: Callable[[], None]) -> None:
    override_method(optimizer, "zero_grad", _zero_grad_with_callback)
    _ZERO_GRAD_CALLBACKS[optimizer] = callback


def remove_zero_grad_hook(optimizer: Optimizer) -> None:
    restore_class(optimizer)
    _ZERO_GRAD_CALLBACKS.pop(optimizer, None)
