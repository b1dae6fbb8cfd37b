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

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.core.flat.flat_param import FlatParam

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


def param_owners(optimizers: list[Optimizer]) -> dict[int, tuple[tuple[int, int], ...]]:
    """``id(param)`` → its (optimizer index, param group index) in every optimizer that holds it, ascending by
    optimizer. Several optimizers may hold one parameter (manual optimization alternating two optimizers over one
    layer, a GAN whose generator's optimizer also covers a shared layer), as under DDP; one optimizer holds a
    parameter in one group only (torch refuses otherwise; checked again here for groups edited by hand)."""
    owners: dict[int, list[tuple[int, int]]] = {}
    for opt_index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                held = owners.setdefault(id(param), [])
                if held and held[-1][0] == opt_index:
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} appears twice in optimizer {opt_index}'s param "
                        f"groups ({held[-1][1]} and {group_index}); ZeRO needs each parameter in one group of each "
                        "optimizer that holds it."
                    )
                held.append((opt_index, group_index))
    return {key: tuple(held) for key, held in owners.items()}


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
# so the optimizer gets an *instance* attribute ``zero_grad`` that calls its class's method, then the engine's
# callback. Its class stays the user's (``type(opt) is torch.optim.AdamW``, isinstance, pickle), and nothing leaks
# into a copy: ``Optimizer.__getstate__`` keeps only defaults/state/param_groups, so pickle and deepcopy drop the
# attribute. release() removes it. (Lightning's wrapper subclasses the optimizer's class, so it would find the
# class's method first: the Lightning adapter makes its wrappers call the optimizer's own zero_grad.)
# The callback is looked up on the optimizer at each call, not kept in the attribute: wrappers that copy the
# optimizer's ``__dict__`` (Fabric's ``_FabricOptimizer``) copy the attribute once, and a later binding (a rebuilt
# engine) must still be the one notified. Nor is it kept in a module-level table keyed by optimizer: the callback
# reaches the optimizer again (through the engine), so such a table would keep every optimizer and engine alive.
_CALLBACK = "_zero_strategy_on_zero_grad"


class _NotifyingZeroGrad:
    """The instance attribute ``zero_grad``: the class's method, then the engine's callback."""

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)  # the optimizer holds this attribute: no cycle through it

    def __call__(self, set_to_none: bool = True) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            return
        class_zero_grad(optimizer, set_to_none)
        callback = vars(optimizer).get(_CALLBACK)
        if callback is not None:  # None once the engine released the optimizer: a plain zero_grad
            callback()


FORWARDS_ZERO_GRAD = "_zero_strategy_forwards_zero_grad"
"""Marks a subclass whose ``zero_grad`` only forwards to the instance attribute (the Fabric adapter's, see
fabric/optimizer_class.py)."""


def class_zero_grad(optimizer: Optimizer, set_to_none: bool) -> None:
    """The ``zero_grad`` of the optimizer's class, passing over a subclass marked :data:`FORWARDS_ZERO_GRAD`."""
    for klass in type(optimizer).__mro__:
        if "zero_grad" in vars(klass) and not vars(klass).get(FORWARDS_ZERO_GRAD, False):
            vars(klass)["zero_grad"](optimizer, set_to_none=set_to_none)
            return


def install_zero_grad_hook(optimizer: Optimizer, callback: Callable[[], None]) -> None:
    """After ``optimizer.zero_grad()``, also run ``callback``. Idempotent (a second call replaces the callback)."""
    installed = vars(optimizer).get("zero_grad")
    if installed is not None and not isinstance(installed, _NotifyingZeroGrad):
        raise ValueError(
            f"{qualified_name(optimizer)} already has an instance attribute 'zero_grad' (set by other code); ZeRO "
            "needs to extend zero_grad to clear the gradients it keeps on the module. Remove that attribute."
        )
    vars(optimizer)[_CALLBACK] = callback
    if installed is None:
        optimizer.zero_grad = _NotifyingZeroGrad(optimizer)  # type: ignore[method-assign]


def remove_zero_grad_hook(optimizer: Optimizer) -> None:
    """Undo :func:`install_zero_grad_hook`. Idempotent."""
    vars(optimizer).pop(_CALLBACK, None)
    if isinstance(vars(optimizer).get("zero_grad"), _NotifyingZeroGrad):
        del optimizer.zero_grad


def bind_optimizer(optimizer: Optimizer, index: int, flats: list[FlatParam], on_zero_grad: Callable[[], None]) -> None:
    """Make ``optimizer`` (the engine's optimizer ``index``) step the master pieces of ``flats`` (the FlatParams of
    its parameters) instead of the module's parameters, carrying over any state it already holds (Adagrad creates
    some at construction). A piece another optimizer steps too is listed by both; each keeps its own state."""
    existing = dict(optimizer.state)
    pieces_by_group: dict[int, list[nn.Parameter]] = {}
    for flat in flats:
        for piece, group_index in zip(flat.master_pieces, flat.piece_group_in(index), strict=True):
            pieces_by_group.setdefault(group_index, []).append(piece)
    repoint_param_groups(optimizer, pieces_by_group)
    optimizer.state.clear()
    if existing:
        for flat in flats:
            carry_state_over(optimizer, flat, existing)
    install_zero_grad_hook(optimizer, on_zero_grad)


def carry_state_over(optimizer: Optimizer, flat: FlatParam, existing: dict) -> None:
    """Give each master piece the slices of the state its parameters already had."""
    by_name = dict(zip(flat.names, flat.params, strict=True))
    overlaps = flat.layout.overlaps(flat.rank)
    for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
        parts = [o for o in overlaps if offset <= o.shard_start < offset + piece.numel()]
        carved = [carve_state(existing.get(by_name[o.name], {}), by_name[o.name], o.param_start, o.numel)
                  for o in parts]
        if not carved or not carved[0] or any(c.keys() != carved[0].keys() for c in carved):
            continue  # no state yet, or parameters in different states: the optimizer starts this piece fresh
        state = dict(carved[0])
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                state[key] = torch.cat([c[key] for c in carved]).to(piece.device)
        optimizer.state[piece] = state
