"""Tensor parallelism under Fabric: the ``parallelize_fn`` of Lightning's Fabric ``ModelParallelStrategy``, applied
by the ZeroFabricStrategy before ZeRO shards the module.

[Note: the parallelize_fn under Fabric]
``ZeroFabricStrategy(stage=s, tensor_parallel_size=K, parallelize_fn=fn)`` takes the function written for
``ModelParallelStrategy(parallelize_fn=fn, tensor_parallel_size=K)``: ``fabric.setup(model)`` (or
``setup_module``) calls ``fn(model, device_mesh)`` with the same 2-D mesh ``("data_parallel", "tensor_parallel")``
and sets up the module it returns; the engine then shards that module's (DTensor) parameters over the
data-parallel group (see [Note: ZeRO over the data-parallel dimension of a 2-D mesh] in core/plan/tensor_parallel.py).
What differs from ModelParallelStrategy:
- ``fn`` applies the tensor-parallel plan only; the ``fully_shard`` calls it makes for ModelParallelStrategy are
  ZeRO's job here (a module FSDP2 already sharded would be sharded twice: drop them from ``fn``);
- an optimizer passed together with the module (``fabric.setup(model, optimizer)``) holds the parameters ``fn``
  replaced (``parallelize_module`` makes new DTensor parameters), so it is refused with the order that works, the
  one ModelParallelStrategy needs too: ``setup_module``, then the optimizer, then ``setup_optimizers``;
- ``tensor_parallel_size=1`` with ``fn`` gives ``fn`` a mesh of shape ``(world, 1)``, as ModelParallelStrategy does;
  ZeRO's layout is then its usual one (``shard_group_size`` and the rest apply).
The spawn and forkserver launchers pickle the strategy into each rank, so ``fn`` must then be a top-level function
(as under Lightning); a lambda or local function is refused when the strategy is built, not in the ranks.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from zero_strategy.adapter_plumbing.process_group import tensor_parallel_mesh
from zero_strategy.config import ZeroConfig

# (module, DeviceMesh) -> module; the mesh is typed Any: the adapters import nothing from torch.distributed
ParallelizeFn = Callable[[Any, Any], Any]
PICKLING_START_METHODS = ("spawn", "forkserver")  # the launchers that send the strategy to each rank by pickling


class TensorParallelCheckpointError(NotImplementedError):
    """What Fabric's checkpoints do not do with a tensor-parallel module yet: ``fabric.load_raw``, the consolidated
    file (``state_dict_type="full"`` or a ``filter``) and loading one (see [Note: Fabric checkpoints with tensor
    parallelism] in fabric/checkpoint.py)."""


class Parallelize:
    """The user's ``parallelize_fn`` (or none), its mesh when ``tensor_parallel_size`` is 1, and its application."""

    def __init__(self, fn: ParallelizeFn | None, start_method: str) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"parallelize_fn={fn!r} is not callable: pass a function (module, device_mesh) -> module")
        if fn is not None and start_method in PICKLING_START_METHODS:
            try:
                pickle.dumps(fn)
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                raise ValueError(
                    f"parallelize_fn={fn!r} cannot be pickled ({error}), and start_method={start_method!r} pickles "
                    "the strategy into each rank: define it as a top-level function of a module, or use "
                    "start_method='popen' (the default)."
                ) from None
        self.fn = fn

    def mesh(self, device: torch.device, world_size: int, config: ZeroConfig) -> Any | None:
        """The ``(world, 1)`` mesh ``fn`` gets when ``tensor_parallel_size`` is 1 (the mesh ModelParallelStrategy
        builds); None otherwise (K > 1: the plumbing's mesh). Collective."""
        if self.fn is None or config.tensor_parallel_size > 1:
            return None
        return tensor_parallel_mesh(device.type, world_size, 1, even_for_one=True)

    def apply(self, module: nn.Module, mesh: Any, optimizers: list[Optimizer]) -> nn.Module:
        """``fn(module, mesh)`` (``module`` itself without one), checked: a module comes back,
        and ``optimizers`` still hold its parameters (see [Note: the parallelize_fn under Fabric])."""
        if self.fn is None:
            return module
        result = self.fn(module, mesh)
        if not isinstance(result, nn.Module):
            raise TypeError(f"parallelize_fn must return the nn.Module it parallelized, got {type(result).__name__}")
        held = {id(p) for p in result.parameters()}
        given = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) not in held for p in given):
            raise ValueError(
                "parallelize_fn replaced the module's parameters (parallelize_module makes DTensor ones), so the "
                "optimizer passed with it to fabric.setup holds the old ones: set the module up first (model = "
                "fabric.setup_module(model)), then build the optimizer from model.parameters() and set it up "
                "(optimizer = fabric.setup_optimizers(optimizer)), as under ModelParallelStrategy."
            )
        return result
