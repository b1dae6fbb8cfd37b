"""The process group and the rank layout, as both adapters set them up, and the collectives of Lightning's strategy
API (``barrier``, ``broadcast``, ``reduce``/``all_reduce``), which both adapters' strategies delegate to here."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.comm.control import barrier, broadcast_object  # the package's one barrier and broadcast
from zero_strategy.core.comm.exit_teardown import destroy_process_group_at_exit
from zero_strategy.core.plan.topology import RankLayout, TensorParallelGroup, Topology, build_rank_layout

__all__ = ["DeviceMesh", "barrier", "broadcast_object", "destroy_after_spawned_run", "init_process_group",
           "rank_layout", "reduce_tensor", "tensor_parallel_mesh"]

MESH_DIMENSIONS = ("data_parallel", "tensor_parallel")  # the names Lightning's ModelParallelStrategy gives them


def init_process_group(environment: ClusterEnvironment, backend: str, timeout_s: float) -> None:
    """The default process group of the launcher's world (kept when one exists: torchrun, a test harness), torn
    down at interpreter exit when created here (see [Note: destroying the process group at exit])."""
    created_here = not _distributed_is_initialized()
    _init_dist_connection(environment, backend, timeout=timedelta(seconds=timeout_s))
    if created_here and _distributed_is_initialized():
        destroy_process_group_at_exit()


def tensor_parallel_mesh(
    device_type: str, world_size: int, tensor_parallel_size: int, even_for_one: bool = False
) -> DeviceMesh | None:
    """The 2-D mesh ``data_parallel x tensor_parallel`` (K consecutive ranks per TP group, inside a node, as
    ModelParallelStrategy lays it out); None when ``tensor_parallel_size`` is 1, unless ``even_for_one`` (a
    ``(world, 1)`` mesh for a Fabric ``parallelize_fn``). Collective: it creates both dimensions' process groups."""
    if tensor_parallel_size == 1 and not even_for_one:
        return None
    if world_size % tensor_parallel_size:
        raise ZeroConfigError(f"tensor_parallel_size={tensor_parallel_size} does not divide the world of {world_size} "
                              "ranks: use a divisor of the number of processes (devices x nodes).")
    shape = (world_size // tensor_parallel_size, tensor_parallel_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMENSIONS)


def rank_layout(
    config: ZeroConfig, world_size: int, processes_per_node: int, mesh: DeviceMesh | None = None
) -> RankLayout | None:
    """Nodes as the cluster environment defines them (global rank = node rank × processes per node + local rank),
    and the shard / replica groups of ``shard_group_size``, or with a tensor-parallel ``mesh`` its data-parallel
    group as the shard group; None without a process group (one process)."""
    if not _distributed_is_initialized():
        return None
    topology = Topology.uniform(world_size, processes_per_node)
    if mesh is not None:
        data, tensor = MESH_DIMENSIONS
        place = TensorParallelGroup(mesh.get_group(tensor), mesh.get_local_rank(tensor), mesh.size(1))
        return RankLayout(topology, mesh.get_group(data), tensor_parallel=place)
    return build_rank_layout(config.shard_group_size, topology, config.hierarchical_params)


def reduce_tensor(tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None) -> Tensor | Any:
    """Lightning's ``reduce``/``all_reduce`` of a strategy: a tensor reduced over the group as Lightning's DDP
    strategies reduce it; anything else unchanged."""
    if isinstance(tensor, Tensor):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor


def destroy_after_spawned_run() -> None:
    """A spawn-launched rank exits right after teardown: tear the process group down here, together, instead of
    implicitly at interpreter exit, where a gloo rank was seen to abort now and then ("terminate called without an
    active exception") after its work was done. Nothing without a process group."""
    if _distributed_is_initialized():
        barrier()
        dist.destroy_process_group()
