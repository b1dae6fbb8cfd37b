"""What every Comm over a real process group shares: object collectives and the barrier go through the backend
(the barrier and the object broadcast are control.py's, the package's only ones)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.control import barrier_on, broadcast_object_on
from zero_strategy.core.comm.work import Work


class BackendComm(Comm):
    """A Comm over a torch.distributed process group (the network transports derive from it)."""

    def barrier(self, label: str) -> Work:
        with self.log.blocking("barrier"):
            barrier_on(self.group.handle, self.group.device)
        return Work.done()

    def broadcast_object(self, obj: Any, src: int, label: str) -> Any:
        with self.log.blocking("broadcast"):
            return broadcast_object_on(obj, self.group.global_rank(src), self.group.handle)

    def all_gather_object(self, obj: Any, label: str) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        with self.log.blocking("all_gather"):
            dist.all_gather_object(gathered, obj, group=self.group.handle)
        return gathered
