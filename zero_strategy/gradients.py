"""Gradients under ZeRO, as a user reads them: ``grad_norm``, the cheap way to Lightning's ``grad_norm``.

A parameter's ``p.grad`` reads as DDP's (see [Note: p.grad as under DDP] in core/engine/ddp_gradients.py), so
``lightning.pytorch.utilities.grad_norm(self, 2)`` gives DDP's numbers, at the cost of gathering the full fp32
gradients once per step. :func:`grad_norm` takes the same arguments and returns the same keys and values, computed
from the slices every rank holds with one all-reduce of two numbers per parameter; on a module no ZeRO engine
shards it is Lightning's computation, so the same ``training_step`` code runs under any strategy.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zero_strategy.core.engine.ddp_gradients import GradientReadError
from zero_strategy.core.engine.engine import engine_of
from zero_strategy.core.flat.grad_reads import ShardedGradientWarning

__all__ = ["GradientReadError", "ShardedGradientWarning", "grad_norm"]


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and their total, as ``lightning.pytorch.utilities.grad_norm`` computes them
    under DDP: keys ``grad_{norm_type}_norm{group_separator}{name}`` for every parameter of ``module`` that has a
    gradient, and ``grad_{norm_type}_norm_total`` (the norm of all of them as one vector); values 0-d tensors.

    Under ZeRO the gradient of a parameter is the one the optimizer step uses: averaged over every rank and
    accumulated since it was last cleared (``zero_grad()``), whatever the stage. That equals DDP's wherever DDP's
    gradients are synchronized: in ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (fp16:
    unscaled there, as Lightning unscales before them), and in ``on_after_backward`` of the micro-batch that
    synchronizes (every one without accumulation, the last of each window with it). At the other micro-batches
    DDP's ``p.grad`` is each rank's own unsynchronized sum; here it is the average accumulated so far. A parameter
    no rank produced a gradient for is left out, as under DDP; so is a parameter no optimizer steps.

    Collective under ZeRO: every rank must call it at the same point (one all-reduce of two numbers per parameter;
    at stage 1 the gradients still on the module are reduced first, which the step then need not do). It does not
    end an accumulation window: later micro-batches still add to what the step uses.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    named = list(module.named_parameters())
    engine = engine_of(module)
    if engine is None:  # not sharded here: Lightning's own computation from p.grad
        values: list[Tensor | None] = [
            param.grad.data.norm(norm_type) if param.grad is not None else None for _, param in named
        ]
    else:
        values = engine.parameter_grad_norms([param for _, param in named], norm_type)
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": value
        for (name, _), value in zip(named, values, strict=True)
        if value is not None
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack([value.float().cpu() for value in norms.values()]).norm(
            norm_type
        )
    return norms
