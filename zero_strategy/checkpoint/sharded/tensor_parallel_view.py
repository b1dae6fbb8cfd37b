"""A tensor-parallel checkpoint read as whole tensors: by parameter name and element range of the *whole* tensor, as
an ordinary sharded checkpoint is read (see [Note: tensor-parallel checkpoint layout] in
checkpoint/sharded/tensor_parallel.py). ``zero-to-fp32`` and ``--hf`` stream it as they stream our own checkpoints;
a run without tensor parallelism resumes from it (weights, optimizer state, RNG of coordinate 0's ranks), and a
run at another TP size through checkpoint/sharded/tensor_parallel_blocks.py.

[Note: whole-tensor ranges of a Shard(d) parameter]
Seen as ``[outer, n, inner]`` (``n`` the size of dimension ``d``), TP coordinate ``t`` holds rows ``o_t .. o_t+l_t``
of the middle dimension, stored row-major as its own ``[outer, l_t, inner]`` block. Element ``i`` of the whole
tensor is ``(a, j, k)`` with ``i = (a * n + j) * inner + k``; it sits in the block whose rows hold ``j``, at
``(a * l_t + j - o_t) * inner + k``. A run of the whole tensor stays inside one block until the end of that
block's rows (``(o_t + l_t - j) * inner - k`` elements), so a range is read as a few contiguous ranges of the
blocks, never the whole tensor at once: memory stays near the range read. Block offsets come from the parts' own
shapes (in TP order), so any split torch makes (uneven last block included) is read as it was written.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import CheckpointError, FlatEntry, Manifest, ParamEntry
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.tensor_parallel import TensorParallelManifest, open_part


@dataclass(frozen=True, slots=True)
class _Blocks:
    """How one parameter's whole tensor is split over the TP coordinates."""

    dim: int | None  # the sharded dimension; None: coordinate 0's block is the whole tensor
    outer: int
    rows: int  # size of dimension ``dim``
    inner: int
    starts: list[int]  # each coordinate's first row along ``dim``
    lengths: list[int]

    def runs(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """``(coordinate, start in its block, count)`` covering whole-tensor elements ``[start, start+count)`` (see
        [Note: whole-tensor ranges of a Shard(d) parameter])."""
        if self.dim is None:
            return [(0, start, count)]
        out: list[tuple[int, int, int]] = []
        while count > 0:
            a, rest = divmod(start, self.rows * self.inner)
            j, k = divmod(rest, self.inner)
            t = bisect.bisect_right(self.starts, j) - 1  # the last block starting at or before row j: it holds j
            local = (a * self.lengths[t] + j - self.starts[t]) * self.inner + k
            take = min(count, (self.starts[t] + self.lengths[t] - j) * self.inner - k)
            out.append((t, local, take))
            start, count = start + take, count - take
        return out


def _blocks(name: str, shape: list[int], dim: int | None, parts: list[ShardedCheckpoint]) -> _Blocks:
    """The split of ``name`` recorded by the parts, checked against its whole shape."""
    local = [list(part.params[name][1].shape) for part in parts]
    if dim is None:
        if local[0] != shape:
            raise CheckpointError(f"{parts[0].path}: {name} has shape {local[0]}, the whole tensor {shape}")
        return _Blocks(None, 1, 1, 1, [0], [math.prod(shape)])
    lengths = [block[dim] for block in local]
    others = [block[:dim] + block[dim + 1 :] for block in local]
    if any(other != shape[:dim] + shape[dim + 1 :] for other in others) or sum(lengths) != shape[dim]:
        raise CheckpointError(f"{name}: the parts' blocks {local} do not make its whole shape {shape} along {dim}")
    starts = [sum(lengths[:t]) for t in range(len(lengths))]
    return _Blocks(dim, math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :]), starts, lengths)


class TensorParallelView:
    """A tensor-parallel checkpoint directory as whole tensors (see the module docstring). Opening validates every
    part's files, and every parameter's blocks against its recorded whole shape."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.tp = TensorParallelManifest.read(self.path)
        self.parts: list[ShardedCheckpoint] = []
        try:
            for coordinate in range(self.tp.tensor_parallel_size):
                self.parts.append(open_part(self.path, coordinate))
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        first = self.parts[0]
        missing = sorted(set(self.tp.params) ^ set(first.params))
        if missing:
            raise CheckpointError(f"{self.path}: the manifest and the parts list different parameters: {missing[:5]}")
        self._blocks: dict[str, _Blocks] = {}
        self._real: dict[str, str] = {}  # the whole-tensor FlatEntry's key -> its parameter
        self.params: dict[str, tuple[FlatEntry, ParamEntry]] = {}
        for name, whole in self.tp.params.items():
            self._blocks[name] = _blocks(name, whole.global_shape, whole.sharded_dim(), self.parts)
            flat, param = first.params[name]
            numel = math.prod(whole.global_shape)
            entry = ParamEntry(name, list(whole.global_shape), 0, numel, list(param.groups))
            key = f"whole/{name}"
            self.params[name] = (FlatEntry(key, flat.dtype, list(flat.optimizers), numel, [entry]), entry)
            self._real[key] = name
        # what the exports and the resume checks read: the first part's, with whole-tensor entries and the id of
        # the tensor-parallel checkpoint
        self.manifest: Manifest = replace(
            first.manifest, checkpoint_id=self.tp.checkpoint_id, world_size=1,
            flat_params=[flat for flat, _ in self.params.values()],
        )

    # ------------------------------------------------------------------------------------------- reading
    def read_param(
        self, name: str, tensor_of: str = "flat", start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        """Elements ``[start, start+count)`` of the whole tensor of ``name`` (weights or one optimizer state)."""
        count = self.params[name][1].numel - start if count is None else count
        pieces = [self.parts[t].read_param(name, tensor_of, local, take, optimizer)
                  for t, local, take in self._blocks[name].runs(start, count)]
        if not pieces:
            return self.parts[0].read_param(name, tensor_of, 0, 0, optimizer)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        name = self._real[flat.key]
        return self.parts[0].state_names(self.parts[0].params[name][0], optimizer)

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        name = self._real[flat.key]
        t, local, _ = self._blocks[name].runs(position, 1)[0]
        part_flat, part_param = self.parts[t].params[name]
        return self.parts[t].scalar_state_at(part_flat, part_param.offset + local, optimizer)

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        """The generator states of data-parallel rank ``rank`` of TP coordinate 0."""
        return self.parts[0].rng_state(rank)

    def trainer_state(self, weights_only: bool | None = True) -> dict[str, Any]:
        return self.parts[0].trainer_state(weights_only)

    @property
    def version_dir(self) -> Path:
        """Where the trainer state (and the buffers in it) is read: coordinate 0's (every part holds the same)."""
        return self.parts[0].version_dir

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def __enter__(self) -> TensorParallelView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

