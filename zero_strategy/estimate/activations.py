"""Activation bytes for ``zero-estimate``: what autograd keeps for backward after one forward, measured in this
process on one rank's micro-batch (ZeRO shards no activations, so they are the same at every stage)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.precision_names import COMPUTE_DTYPES, normalize_precision


@contextmanager
def _in_compute_dtype(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Temporarily give ``model`` the parameter dtypes ZeRO computes with (norm layers stay fp32) and run under
    autocast, so saved activations have the dtype of a real run; the original tensors are put back afterwards."""
    if dtype == torch.float32:
        yield
        return
    keep = MixedPrecisionPolicy(dtype).full_precision_params(model)
    originals = {p: p.data for p in model.parameters() if p.is_floating_point() and id(p) not in keep}
    device = next((p.device.type for p in model.parameters()), "cpu")
    try:
        for param, data in originals.items():
            param.data = data.to(dtype)
        with torch.autocast(device, dtype=dtype):
            yield
    finally:
        for param, data in originals.items():
            param.data = data


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
    """Call the model on the batch (a tensor, a tuple of arguments or a dict of keywords); sum what it returns."""
    out = model(**batch) if isinstance(batch, dict) else model(*batch) if isinstance(batch, tuple) else model(batch)
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise ValueError("the model's output has no floating-point tensor that requires grad; pass loss_fn=")
    return torch.stack([t.float().sum() for t in tensors]).sum()


def measure_activation_bytes(
    model: nn.Module, sample_batch: Any, precision: str = "32-true",
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
) -> int:  # fmt: skip
    """Bytes autograd keeps for backward after one forward of ``model`` on ``sample_batch`` (one rank's
    micro-batch), measured in this process: a ``torch.autograd.graph.saved_tensors_hooks`` pack hook records every
    distinct storage saved for backward, parameters' own storages excluded (ZeRO counts them as parameters).
    A backward then runs through ``torch.autograd.grad``, so the model's ``.grad`` stay untouched. The default
    loss sums the outputs; pass ``loss_fn(model, batch)`` to include a real loss (cross-entropy keeps its
    softmax). Activation checkpointing is not modelled: measure with the checkpointed model for that."""
    dtype = COMPUTE_DTYPES[normalize_precision(precision)]
    saved: dict[int, int] = {}
    with _in_compute_dtype(model, dtype):
        param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(tensor: Tensor) -> Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in param_storages:
                saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = (loss_fn or _default_loss)(model, sample_batch)
        trained = [p for p in model.parameters() if p.requires_grad]
        if trained and loss.requires_grad:
            torch.autograd.grad(loss, trained, allow_unused=True)
    return sum(saved.values())
