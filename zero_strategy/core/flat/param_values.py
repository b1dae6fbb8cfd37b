"""Where a module's parameter reads its values from: the one way the flat room re-points a parameter at a view of a
flat buffer, for plain parameters and for the DTensors of a tensor-parallel plan alike."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def point_at(param: nn.Parameter | Tensor, values: Tensor) -> None:
    """``param`` reads ``values`` (its local block's shape) from now on, with a version counter of its own (see
    [Note: views into one flat buffer] in flat_param.py).

    A DTensor parameter computes with its ``_local_tensor``, which assigning ``.data`` does not reach: ``.data``
    gets a DTensor of the same mesh and placements (the parameter's dtype and version counter follow it) and the
    local tensor is re-pointed at ``values`` itself, so that gathering into and freeing the flat buffer reach
    forward exactly as for a plain parameter."""
    if isinstance(param, DTensor):
        param.data = DTensor.from_local(values, param.device_mesh, param.placements, shape=param.shape,
                                        stride=param.stride(), run_check=False)
        param._local_tensor = values
    else:
        param.data = values


def as_parameter_value(param: nn.Parameter | Tensor, values: Tensor) -> Tensor:
    """``values`` (a local block) shaped as what ``param``'s ``.grad`` or state holds: a DTensor in ``param``'s
    placements for a tensor-parallel parameter, ``values`` itself otherwise."""
    if isinstance(param, DTensor):
        return DTensor.from_local(values, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return values


def real_placeholder(param: nn.Parameter | Tensor, view: Tensor) -> nn.Parameter:
    """An empty parameter on ``view``'s device to swap a meta ``param`` with (``.data`` of a meta parameter cannot
    point at real storage): a DTensor of ``param``'s mesh and placements for a tensor-parallel parameter built on
    the meta device (see [Note: tensor-parallel parameters built on the meta device] in
    core/init/distributed_origins.py), so that it keeps its class and the swap its slots."""
    empty = torch.empty(0, dtype=view.dtype, device=view.device)
    if isinstance(param, DTensor):
        empty = DTensor.from_local(view, param.device_mesh, param.placements, shape=param.shape,
                                   stride=param.stride(), run_check=False)
    return nn.Parameter(empty, requires_grad=param.requires_grad)


def meta_placeholder(param: nn.Parameter | Tensor) -> nn.Parameter:
    """A storage-less parameter of ``param``'s shape and dtype to swap it with when its values leave the module (a
    DTensor of the same mesh and placements for a tensor-parallel parameter, keeping its class and slots)."""
    empty = torch.empty(param.shape, dtype=param.dtype, device="meta")
    if isinstance(param, DTensor):
        local = torch.empty(param._local_tensor.shape, dtype=param.dtype, device="meta")
        empty = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                   stride=param.stride(), run_check=False)
    return nn.Parameter(empty, requires_grad=param.requires_grad)
