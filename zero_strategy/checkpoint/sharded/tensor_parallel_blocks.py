"""Resuming at another tensor-parallel size: a checkpoint of whole tensors read as the blocks this rank's plan gives
it, and the choice of what a run reads (:func:`open_for_run`).

[Note: a run's block of a whole tensor]
A parameter the run's plan shards (``Shard(d)`` over its TP group of ``K`` ranks) holds, on TP coordinate ``t``,
rows ``o .. o+l`` of dimension ``d`` of the whole tensor (seen as ``[outer, n, inner]``), stored row-major as
``[outer, l, inner]``: element ``(a, j, k)`` of the block is element ``(a * n + o + j) * inner + k`` of the whole, and
a run of the block stays contiguous in the whole tensor until the end of the block's rows. So a range of the block
is read as a few ranges of the whole tensor, from any reader of whole tensors: an ordinary checkpoint (saved
without tensor parallelism) or a tensor-parallel one through :class:`TensorParallelView` (at any TP size). ``o``
follows torch's split (``ceil(n / K)`` rows per coordinate, the last ones fewer or none), and is checked against
the block the parameter actually holds. Element-wise optimizer state maps the same way; a piece's scalar state
(``step``) is the one saved for the whole-tensor element its first element maps to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, CheckpointError, FlatEntry, Manifest, ParamEntry
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.tensor_parallel import (
    TensorParallelManifest,
    TensorParallelParam,
    is_tensor_parallel_directory,
    open_part,
)
from zero_strategy.checkpoint.sharded.tensor_parallel_view import TensorParallelView


class _WholeTensors(Protocol):
    """A reader of whole tensors by name and element range (ShardedCheckpoint, TensorParallelView)."""

    path: Path
    params: dict[str, tuple[FlatEntry, ParamEntry]]
    manifest: Manifest

    def read_param(self, name: str, tensor_of: str = ..., start: int = ..., count: int | None = ...,
                   optimizer: int | None = ...) -> Tensor: ...

    def state_names(self, flat: FlatEntry, optimizer: int | None = ...) -> list[str]: ...

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = ...) -> dict[str, Any]: ...

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None: ...

    def trainer_state(self, weights_only: bool | None = ...) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Block:
    """Where this rank's block of one parameter sits in the whole tensor (see [Note: a run's block of a whole
    tensor]); ``dim`` None: the block is the whole tensor."""

    dim: int | None
    rows: int
    inner: int
    start: int
    length: int

    def whole_runs(self, start: int, count: int) -> list[tuple[int, int]]:
        """``(start in the whole tensor, count)`` covering block elements ``[start, start+count)``."""
        if self.dim is None:
            return [(start, count)]
        out: list[tuple[int, int]] = []
        while count > 0:
            a, rest = divmod(start, self.length * self.inner)
            j, k = divmod(rest, self.inner)
            take = min(count, (self.length - j) * self.inner - k)
            out.append(((a * self.rows + self.start + j) * self.inner + k, take))
            start, count = start + take, count - take
        return out


def run_blocks(module: nn.Module) -> dict[str, tuple[_Block, list[int]]]:
    """Each parameter of ``module`` (canonical names): where this rank's block sits, and the block's shape."""
    blocks: dict[str, tuple[_Block, list[int]]] = {}
    for name, param in module.named_parameters():
        shape = list(param.shape)
        if not isinstance(param, DTensor):
            blocks[name] = (_Block(None, 1, 1, 0, 0), shape)
            continue
        local = list(param._local_tensor.shape)
        dim = TensorParallelParam(shape, [repr(p) for p in param.placements]).sharded_dim()
        if dim is None:
            blocks[name] = (_Block(None, 1, 1, 0, 0), local)
            continue
        size, coordinate = param.device_mesh.size(), param.device_mesh.get_local_rank()
        start = min(coordinate * math.ceil(shape[dim] / size), shape[dim])  # torch's split of Shard(d)
        if start + local[dim] > shape[dim]:
            raise CheckpointError(f"{name}: the block of TP coordinate {coordinate} ({local}) is not torch's split of "
                                  f"{shape} along {dim} into {size}")
        blocks[name] = (_Block(dim, shape[dim], math.prod(shape[dim + 1 :]), start, local[dim]), local)
    return blocks


class LocalBlocksView:
    """A checkpoint of whole tensors read as this rank's blocks (see [Note: a run's block of a whole tensor])."""

    def __init__(self, whole: _WholeTensors, module: nn.Module) -> None:
        self.whole = whole
        self.path = whole.path
        self._blocks: dict[str, _Block] = {}
        self._real: dict[str, str] = {}  # this view's FlatEntry key -> its parameter
        self.params: dict[str, tuple[FlatEntry, ParamEntry]] = {}
        for name, (block, local) in run_blocks(module).items():
            if name not in whole.params:
                continue  # missing from the checkpoint: check_compatible says so (or a non-strict load skips it)
            flat, param = whole.params[name]
            if list(param.shape) != list(module.get_parameter(name).shape):
                raise CheckpointError(f"{whole.path}: {name} has shape {list(param.shape)}, the model's whole "
                                      f"tensor {list(module.get_parameter(name).shape)}: a checkpoint of another model")
            numel = math.prod(local)
            entry = ParamEntry(name, local, 0, numel, list(param.groups))
            key = f"block/{name}"
            self.params[name] = (FlatEntry(key, flat.dtype, list(flat.optimizers), numel, [entry]), entry)
            self._blocks[name], self._real[key] = block, name
        self.manifest = replace(whole.manifest, world_size=1, flat_params=[f for f, _ in self.params.values()])

    def read_param(
        self, name: str, tensor_of: str = "flat", start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        count = self.params[name][1].numel - start if count is None else count
        pieces = [self.whole.read_param(name, tensor_of, first, take, optimizer)
                  for first, take in self._blocks[name].whole_runs(start, count)]
        if not pieces:
            return self.whole.read_param(name, tensor_of, 0, 0, optimizer)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        return self.whole.state_names(self.whole.params[self._real[flat.key]][0], optimizer)

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        name = self._real[flat.key]
        whole_flat, whole_param = self.whole.params[name]
        first = self._blocks[name].whole_runs(position, 1)[0][0]
        return self.whole.scalar_state_at(whole_flat, whole_param.offset + first, optimizer)

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        return self.whole.rng_state(rank)

    def trainer_state(self, weights_only: bool | None = True) -> dict[str, Any]:
        return self.whole.trainer_state(weights_only)

    def close(self) -> None:
        self.whole.close()


RunCheckpoint = ShardedCheckpoint | TensorParallelView | LocalBlocksView


def open_for_run(path: Path, size: int, coordinate: int, module: nn.Module | None) -> RunCheckpoint:
    """What a rank at TP coordinate ``coordinate`` of a run with ``tensor_parallel_size=size`` resumes from: its part
    of a tensor-parallel checkpoint of the same TP size (any data-parallel size); otherwise whole tensors (an
    ordinary checkpoint, or a tensor-parallel one through :class:`TensorParallelView`), read as the blocks the
    run's plan gives ``module``'s parameters."""
    tensor_parallel = is_tensor_parallel_directory(path)
    if tensor_parallel and TensorParallelManifest.read(path).tensor_parallel_size == size:
        return open_part(path, coordinate)
    if size == 1:
        return TensorParallelView(path) if tensor_parallel else ShardedCheckpoint(path)
    if module is None:
        raise CheckpointError(f"{path}: resuming at tensor_parallel_size={size} from a checkpoint saved with another "
                              "needs the module (its plan says which block each rank reads)")
    if not tensor_parallel and not (path / MANIFEST_NAME).is_file():
        return ShardedCheckpoint(path)  # raises, naming what is missing
    whole: _WholeTensors = TensorParallelView(path) if tensor_parallel else ShardedCheckpoint(path)
    try:
        return LocalBlocksView(whole, module)
    except BaseException:
        whole.close()
        raise
