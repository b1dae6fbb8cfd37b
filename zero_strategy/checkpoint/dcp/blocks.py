"""A DCP checkpoint read by a run: each parameter's whole tensor read as the block this rank's tensor-parallel plan
gives it, and each rank's RNG state found by its place in the saving run.

A DCP directory records every tensor at its whole shape (ours with tensor parallelism too: [Note: DCP boxes of a
tensor-parallel block] in checkpoint/dcp/tensor_parallel.py; FSDP2's and ModelParallelStrategy's likewise), so a
run at any tensor-parallel size reads a range of its block as the few ranges of the whole tensor that hold it
([Note: a run's block of a whole tensor] in checkpoint/sharded/tensor_parallel_blocks.py) and DCP's reader fills
them from whichever stored chunks intersect them. Parameter entries, shapes and optimizer-state names stay those of
the whole tensors: the resume checks compare whole shapes (a DTensor's ``shape`` is its global one).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor, nn

from zero_strategy.checkpoint.dcp.reader import WEIGHTS, DcpCheckpoint
from zero_strategy.checkpoint.sharded.tensor_parallel_blocks import _Block, run_blocks


class DcpBlocks(DcpCheckpoint):
    """``path`` read as ``module``'s blocks (see the module docstring); ``tensor_parallel``: this run's
    (tensor_parallel_size, this rank's TP coordinate)."""

    def __init__(self, path: str | os.PathLike, module: nn.Module, tensor_parallel: tuple[int, int] = (1, 0)) -> None:
        keys = [key for key, value in module.state_dict(keep_vars=True).items() if isinstance(value, Tensor)]
        super().__init__(path, expected=keys)
        self._blocks: dict[str, tuple[_Block, int]] = {
            name: (block, math.prod(local)) for name, (block, local) in run_blocks(module).items()
            if block.dim is not None and name in self.params
        }
        self.tensor_parallel = tensor_parallel

    def read_param(
        self, name: str, tensor_of: str = WEIGHTS, start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        """Elements ``[start, start + count)`` of this rank's block of ``name`` (its whole tensor when the plan
        does not shard it), from its weights or an optimizer state."""
        if name not in self._blocks:
            return super().read_param(name, tensor_of, start, count, optimizer)
        block, numel = self._blocks[name]
        count = numel - start if count is None else count
        pieces = [super(DcpBlocks, self).read_param(name, tensor_of, first, take, optimizer)
                  for first, take in block.whole_runs(start, count)]
        if not pieces:
            return super().read_param(name, tensor_of, 0, 0, optimizer)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        """The RNG state of data-parallel rank ``rank`` at this rank's TP coordinate of the saving run (world rank
        ``rank·K + t`` of a save with ``tensor_parallel_size=K``; coordinate 0's when the TP sizes differ)."""
        info: dict[str, Any] = self.info or {}
        saved = int(info.get("tensor_parallel_size", 1))
        if saved == 1:
            return super().rng_state(rank)
        size, coordinate = self.tensor_parallel
        return super().rng_state(rank * saved + (coordinate if size == saved else 0))
