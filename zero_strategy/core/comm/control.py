"""Control-plane exchanges outside any engine (checkpoint publication, the adapters' barrier): free functions over
a process group, on its device (see [Note: collectives run on the group's device] in group.py). The engine's own
exchanges go through its Comms."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zero_strategy.core.comm.group import ProcessGroup, collective_device, distributed


def barrier(handle: ProcessGroup = None) -> None:
    """Every rank of the group reaches this point. NCCL is told this rank's device: without ``device_ids`` it
    guesses one from the rank number, which is wrong when each rank sees one GPU (SLURM)."""
    if not distributed() or dist.get_world_size(handle) == 1:
        return
    device = collective_device(handle)
    if device.type == "cuda":
        dist.barrier(group=handle, device_ids=[device.index])
    else:
        dist.barrier(group=handle)


def broadcast_object(obj: Any, src: int = 0, handle: ProcessGroup = None) -> Any:
    """Global rank ``src``'s picklable object on every rank of the group."""
    if not distributed() or dist.get_world_size(handle) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=handle)
    return holder[0]
