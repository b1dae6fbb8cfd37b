"""Tensor parallelism from ZeRO's side: what a parameter that torch's ``parallelize_module`` turned into a DTensor
looks like to the planner, and what ZeRO flattens of it.

[Note: ZeRO over the data-parallel dimension of a 2-D mesh]
With ``tensor_parallel_size=K`` the world is a mesh ``data_parallel x tensor_parallel`` (TP inside a node, as
Lightning's ModelParallelStrategy builds it). The user's plan makes some parameters DTensors over the
``tensor_parallel`` dimension: ``Shard(d)`` ones (Colwise/Rowwise layers, embeddings) hold a different block on each
TP rank, ``Replicate()`` ones (SequenceParallel norms) the same values everywhere. ZeRO runs over the data-parallel
group only (the ranks with the same TP coordinate, which hold the same blocks) and flattens each parameter's *local*
block: the layout, the slices, the reductions and the checkpoints are those of a data-parallel world of ``world/K``
ranks whose module happens to have smaller tensors. Three things cross the TP dimension, and only these:
- a gradient that autograd left ``Partial`` over TP (a SequenceParallel norm's: each TP rank saw its part of the
  sequence) is summed over TP before it is flattened (``local_gradient``), as the DTensor itself would;
- the global gradient norm and the fp16 overflow flag are agreed over TP after DP, TP-sharded elements counted on
  every TP rank and replicated ones once (core/engine/gradients.py);
- a checkpoint holds one data-parallel checkpoint per TP coordinate (the checkpoint room writes and joins them).
Sharded and replicated parameters go to different FlatParams (``FlatSpec.tensor_sharded``) so the norm can tell them
apart by FlatParam.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def is_distributed(tensor: object) -> bool:
    """A DTensor: a parameter (or gradient) the user's tensor-parallel plan distributed."""
    return isinstance(tensor, DTensor)


def local_part(tensor: Tensor) -> Tensor:
    """The block this rank holds: the local tensor of a DTensor (no autograd edge), the tensor itself otherwise."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def local_shape(tensor: Tensor) -> tuple[int, ...]:
    """The shape of what this rank holds (a DTensor's ``shape`` is the global one)."""
    return tuple(local_part(tensor).shape)


def sharded_over_tensor_parallel(tensor: Tensor) -> bool:
    """Whether TP ranks hold different blocks of it (some placement shards it)."""
    return isinstance(tensor, DTensor) and any(placement.is_shard() for placement in tensor.placements)


def local_gradient(grad: Tensor, param: Tensor) -> Tensor:
    """This rank's block of ``param``'s gradient, in the parameter's own placements: a ``Partial`` gradient is summed
    over the TP ranks first (a collective over the TP group: every TP rank flattens the same FlatParams in the same
    order, running the same program). A plain gradient is returned as it is."""
    if not isinstance(grad, DTensor):
        return grad
    placements = param.placements if isinstance(param, DTensor) else grad.placements
    if tuple(grad.placements) != tuple(placements):
        grad = grad.redistribute(grad.device_mesh, placements)
    return grad._local_tensor


def describe(tensor: Tensor) -> dict[str, Any]:
    """A DTensor's global shape and placements as plain data (checkpoints record them); {} for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return {}
    return {"global_shape": list(tensor.shape), "placements": [repr(p) for p in tensor.placements]}


def local_block(whole: Tensor, param: Tensor) -> Tensor:
    """This rank's block of ``whole`` (a value of ``param``'s global shape), cut as ``param``'s placements cut it
    (``Shard(d)``: ``torch.chunk`` along ``d``, as DTensor cuts); ``whole`` itself for a plain parameter."""
    if not isinstance(param, DTensor):
        return whole
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    block = whole
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            dim = placement.dim  # type: ignore[attr-defined]
            chunks = torch.chunk(block, mesh.size(mesh_dim), dim=dim)
            index = coordinate[mesh_dim]
            block = chunks[index] if index < len(chunks) else block.narrow(dim, 0, 0)
    return block
