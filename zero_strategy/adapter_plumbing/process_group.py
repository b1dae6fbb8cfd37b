"""The process group and the rank layout, as both adapters set them up (the Trainer's imports them from here)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import group as _group

from zero_strategy.config import ZeroConfig
from zero_strategy.core.comm.control import barrier as _barrier
from zero_strategy.core.plan.topology import RankLayout, Topology, build_rank_layout
from zero_strategy.fabric.exit_teardown import destroy_process_group_at_exit


def init_process_group(environment: ClusterEnvironment, backend: str, timeout_s: float) -> None:
    """The default process group of the launcher's world (kept when one exists: torchrun, a test harness), torn
    down at interpreter exit when created here (see [Note: destroying the process group at exit])."""
    created_here = not _distributed_is_initialized()
    _init_dist_connection(environment, backend, timeout=timedelta(seconds=timeout_s))
    if created_here and _distributed_is_initialized():
        destroy_process_group_at_exit()


def rank_layout(config: ZeroConfig, world_size: int, processes_per_node: int) -> RankLayout | None:
    """Nodes as the cluster environment defines them (global rank = node rank × processes per node + local rank),
    and the shard / replica groups of ``shard_group_size``; None without a process group (one process)."""
    if not _distributed_is_initialized():
        return None
    topology = Topology.uniform(world_size, processes_per_node)
    return build_rank_layout(config.shard_group_size, topology, config.hierarchical_params)


def barrier() -> None:
    if _distributed_is_initialized():
        _barrier()  # with device_ids on NCCL


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not _distributed_is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src, group=_group.WORLD)
    return holder[0]
