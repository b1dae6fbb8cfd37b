"""A process group as the comm room sees it: its members and the device its backend takes tensors on.

[Note: collectives run on the group's device]
NCCL refuses CPU tensors and gloo (in this package's use) takes CPU ones, so every tensor handed to a backend
collective lives on the group's device, whatever device the data came from: a norm of CPU-offloaded gradients, a
flag on a rank holding no gradient, a bitmap built on the host. :func:`collective_device` is the one rule; the
comms move a small tensor that is elsewhere (:func:`on_collective_device`) and refuse a flat buffer that is
elsewhere (:func:`check_device`): flat buffers are built on the right device.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = dist.ProcessGroup | None


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def backend_name(handle: ProcessGroup = None) -> str:
    """The backend of ``handle`` (None: the default group), or "none" without a process group."""
    return str(dist.get_backend(handle)) if distributed() else "none"


def collective_device(handle: ProcessGroup) -> torch.device:
    """The device whose tensors ``handle``'s backend accepts: this rank's CUDA device on NCCL, the CPU otherwise."""
    if not distributed():
        return torch.device("cpu")
    backend = str(dist.get_backend(handle))
    if "nccl" in backend and "gloo" not in backend:  # a mixed "cpu:gloo,cuda:nccl" group takes CPU tensors too
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_simulated = threading.local()  # in-process tests run one simulated rank per thread: the ambient group is per thread


@contextmanager
def simulated_rank(group: Any) -> Iterator[None]:
    """Within the block, an engine built on this thread without a process group shards over ``group``, a group
    of ranks simulated by threads (comm/in_process.py; the harness ``zero_strategy.testing.run_in_process``
    enters it on each rank's thread)."""
    _simulated.group = group
    try:
        yield
    finally:
        _simulated.group = None


def simulated_group() -> Any:
    """The simulated group of this thread (see :func:`simulated_rank`), or None."""
    return getattr(_simulated, "group", None)


@dataclass(frozen=True, slots=True)
class Group:
    """Who is in a process group and where its collectives' tensors live."""

    handle: Any  # a process group; None: the default group (or none at all: one process); or a simulated group
    rank: int  # this rank's position in the group
    size: int
    members: tuple[int, ...]  # the global rank of each group rank
    device: torch.device  # see [Note: collectives run on the group's device]

    @classmethod
    def of(cls, handle: Any) -> Group:
        """The group ``handle`` (None: the default group), or a group of this one process without torch.distributed.
        A simulated group (comm/in_process.py) describes itself."""
        if handle is not None and not isinstance(handle, dist.ProcessGroup):
            described: Group = handle.describe()
            return described
        if not distributed():
            return cls(None, 0, 1, (0,), torch.device("cpu"))
        members = tuple(dist.get_process_group_ranks(handle or dist.group.WORLD))
        return cls(handle, dist.get_rank(handle), len(members), members, collective_device(handle))

    @property
    def me(self) -> int:
        """This rank's global rank."""
        return self.members[self.rank]

    @property
    def backend(self) -> str:
        if self.handle is not None and not isinstance(self.handle, dist.ProcessGroup):
            return "simulated"
        return backend_name(self.handle)

    def global_rank(self, group_rank: int) -> int:
        return self.members[group_rank]

    def peers(self) -> Iterator[int]:
        """Group ranks other than this one."""
        return (peer for peer in range(self.size) if peer != self.rank)


def check_device(tensor: Tensor, group: Group, what: str) -> None:
    """A flat buffer on a device the backend cannot take (gloo with a module on a GPU, NCCL with one on the CPU):
    say so before the backend fails with a less helpful message."""
    if tensor.device.type != group.device.type:
        raise RuntimeError(
            f"ZeRO: the {what} buffer is on {tensor.device}, but the process group's backend ({group.backend}) "
            f"needs {group.device} tensors: train on GPUs with NCCL and on CPUs with gloo."
        )


@contextmanager
def on_collective_device(tensor: Tensor, group: Group) -> Iterator[Tensor]:
    """``tensor`` itself when it is on the group's device, else a copy there whose values are written back on exit
    (small tensors only: norms, flags, bitmaps)."""
    if tensor.device == group.device:
        yield tensor
        return
    moved = tensor.to(group.device)
    yield moved
    tensor.copy_(moved)
