"""Binding the user's optimizers to master slices: which optimizers are exact on slices, and the re-pointing.

[Note: why only element-wise optimizers]
ZeRO hands each optimizer a 1-D slice that starts and ends anywhere inside a parameter. An optimizer whose update
of one element depends only on that element's gradient history (SGD, Adam, ...) computes exactly what it would
on whole tensors. One that looks at whole tensors (LAMB's per-tensor trust ratio, Adafactor's row/column
statistics, Shampoo, Muon, LBFGS's line search over all parameters) would be silently wrong, so it is refused.
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

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
        if len(optimizer.state) > 0:
            raise ValueError(
                f"optimizer {opt_index} ({qualified_name(optimizer)}) already has state before ZeRO sharded the "
                "model; create it in configure_optimizers without stepping it, and restore state through a "
                "checkpoint (ckpt_path=...)."
            )
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
