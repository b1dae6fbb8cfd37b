"""The one barrier and the one object broadcast of the package: free functions over a process group, on its
device (see [Note: collectives run on the group's device] in group.py). The comms over a real process group
(backend.py) and everything outside any engine (checkpoint publication, the adapters' Lightning ``barrier`` and
``broadcast``) call these; the engine's own exchanges go through its Comms."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero_strategy.core.comm.group import ProcessGroup, collective_device, distributed


def barrier_on(handle: ProcessGroup, device: torch.device) -> None:
    """Every rank of the group reaches this point. NCCL is told this rank's device: without ``device_ids`` it
    guesses one from the rank number, which is wrong when each rank sees one GPU (SLURM) or ranks do not map to
    devices in order."""
    if device.type == "cuda":
        dist.barrier(group=handle, device_ids=[device.index])
    else:
        dist.barrier(group=handle)


def broadcast_object_on(obj: Any, global_src: int, handle: ProcessGroup) -> Any:
    """Global rank ``global_src``'s picklable object on every rank of the group."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=global_src, group=handle)
    return holder[0]


def barrier(handle: ProcessGroup = None) -> None:
    """:func:`barrier_on` the group's collective device; nothing without a process group or with one rank."""
    if not distributed() or dist.get_world_size(handle) == 1:
        return
    barrier_on(handle, collective_device(handle))


def broadcast_object(obj: Any, src: int = 0, handle: ProcessGroup = None) -> Any:
    """Global rank ``src``'s picklable object on every rank of the group (``obj`` itself without a process group
    or with one rank)."""
    if not distributed() or dist.get_world_size(handle) == 1:
        return obj
    return broadcast_object_on(obj, src, handle)
