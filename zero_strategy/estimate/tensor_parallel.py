"""``zero-estimate --tensor-parallel K``: ZeRO over the data-parallel dimension of a ``data_parallel x
tensor_parallel`` mesh (issue 36), estimated as ZeRO over ``world / K`` ranks of each rank's tensor-parallel shards.

[Note: which parameters the estimate takes as tensor-parallel]
A tensor-parallel plan (``parallelize_module``) is the user's, and the estimator never runs it. It assumes the plan
of torch's TP tutorial, which is what Megatron-style plans do: every ``nn.Linear`` and ``nn.Embedding`` *weight* is
split K ways (attention q/k/v/o and the MLP column-/row-wise, embeddings row-wise, the output layer column-wise);
everything else (norms, biases, other parameters) is replicated on each of the K ranks. Without a model (a
parameter count) every parameter is taken as split (a transformer's norms are well under 1 %). ``tp_fraction`` /
``--tp-fraction F`` replaces either rule: the share F of every parameter's elements is split, the rest replicated
(``--tp-fraction 0`` for a plan that shards activations only). A split tensor's local size is rounded up, as torch
rounds uneven shards. Unit sizes given as counts (``--largest-unit-params``, ``--root-unit-params``) are the
whole model's: they are divided by the same rule. Activations are per rank as given or measured (a measurement
runs the model without the plan). Each TP rank then holds Ψ_local = Ψ_replicated + Ψ_split / K parameters, and
ZeRO shards Ψ_local over the ``world / K`` data-parallel ranks that hold the same shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


def tensor_parallel_weights(model: nn.Module) -> set[int]:
    """Ids of the parameters the tutorial's plan splits: every ``nn.Linear`` and ``nn.Embedding`` weight."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear | nn.Embedding)}


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallel:
    """The tensor-parallel size and which parameters it splits (see [Note: which parameters the estimate takes as
    tensor-parallel])."""

    size: int = 1
    """K: ranks of one tensor-parallel group. 1: no tensor parallelism."""
    fraction: float | None = None
    """Share of every parameter split K ways; None: the Linear and Embedding weights (a model) or all (a count)."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel={self.size}: the tensor-parallel size must be at least 1")
        if self.fraction is not None and not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"tp_fraction={self.fraction}: the share of parameters split must be within [0, 1]")

    def data_parallel_size(self, world_size: int) -> int:
        """The ranks ZeRO shards over: ``world_size / K``; a clear error when K does not divide the world."""
        if world_size % self.size:
            raise ValueError(
                f"tensor_parallel={self.size} does not divide world_size={world_size}: the ranks form a "
                f"data_parallel x tensor_parallel mesh, so the world size must be a multiple of the tensor-parallel "
                f"size (e.g. --world-size {self.size * max(1, world_size // self.size)} or --tensor-parallel "
                f"{math.gcd(world_size, self.size)})"
            )
        return world_size // self.size

    def local_count(self, numel: int) -> int:
        """Elements one TP rank holds of ``numel`` parameters known only by count."""
        if self.size == 1:
            return numel
        split = numel * (1.0 if self.fraction is None else self.fraction)
        return math.ceil(numel - split + split / self.size)

    def local_numel(self, model: nn.Module) -> Callable[[nn.Parameter], int]:
        """Elements one TP rank holds of each of ``model``'s parameters."""
        if self.size == 1:
            return lambda param: param.numel()
        if self.fraction is not None:
            return lambda param: self.local_count(param.numel())
        split = tensor_parallel_weights(model)
        return lambda param: -(-param.numel() // self.size) if id(param) in split else param.numel()

    @property
    def note(self) -> str | None:
        """What the estimate assumed, for its notes (None without tensor parallelism)."""
        if self.size == 1:
            return None
        which = ("Linear and Embedding weights (a model) or every parameter (a count)" if self.fraction is None
                 else f"{self.fraction:.0%} of every parameter")  # fmt: skip
        return (f"tensor parallel {self.size}: {which} split {self.size} ways, the rest replicated; ZeRO shards each "
                f"rank's part over world/{self.size} data-parallel ranks (--tp-fraction to change the split)")
