"""What every Comm over a real process group shares: object collectives and the barrier go through the backend."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.work import Work


class BackendComm(Comm):
    """A Comm over a torch.distributed process group (the network transports derive from it)."""

    def barrier(self, label: str) -> Work:
        """NCCL is told this rank's device: without ``device_ids`` it guesses one from the rank number, which is
        wrong when each rank sees one GPU (SLURM) or ranks do not map to devices in order."""
        with self.log.blocking("barrier"):
            if self.group.device.type == "cuda":
                dist.barrier(group=self.group.handle, device_ids=[self.group.device.index])
            else:
                dist.barrier(group=self.group.handle)
        return Work.done()

    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        holder = [obj]
        with self.log.blocking("broadcast"):
            dist.broadcast_object_list(holder, src=self.group.global_rank(src), group=self.group.handle)
        return holder[0]

    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        with self.log.blocking("all_gather"):
            dist.all_gather_object(gathered, obj, group=self.group.handle)
        return gathered
