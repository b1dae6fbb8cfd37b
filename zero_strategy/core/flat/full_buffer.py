"""The gathered buffer of a FlatParam: every rank's slice side by side, in the compute dtype, what the module's
parameters are views of (see [Note: views into one flat buffer] in flat_param.py).

Two kinds, chosen by EngineComms: a private buffer whose storage is freed and re-made around gathers (stage 3) or
kept for the whole run (stages 1/2), and a host-wide buffer that every local rank maps and reads in place
(comm/host_segments.py's ``HostSharedFull``: stage 3 on one host's CPU ranks). A FlatParam holds either through
this protocol and never asks which.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class FullBuffer(Protocol):
    tensor: Tensor  # 1-D, compute dtype, padded_numel elements

    @property
    def readable_in_place(self) -> bool:
        """The peers' slices are readable where they lie: a gather moves nothing."""
        ...

    @property
    def resizable(self) -> bool:
        """Whether :meth:`free` gives its storage back (the parameters then have no memory until the next gather)."""
        ...

    @property
    def resident_bytes(self) -> int:
        """What this rank holds of the buffer, for the memory report."""
        ...

    def allocate(self) -> None:
        """Give the buffer its storage back before a gather (idempotent)."""
        ...

    def free(self) -> None:
        """Let go of the storage (or of the pages this rank does not own) after use (idempotent)."""
        ...

    def detach(self) -> None:
        """The engine lets go of the module: forget the buffer."""
        ...


class PrivateFull:
    """A buffer in this rank's own memory on the compute device. ``resizable``: freed to zero bytes between
    gathers (stage 3); else kept whole for the whole run (stages 1/2)."""

    readable_in_place = False

    def __init__(self, tensor: Tensor, resizable: bool) -> None:
        self.tensor = tensor
        self.resizable = resizable

    @property
    def resident_bytes(self) -> int:
        return self.tensor.untyped_storage().nbytes()

    def allocate(self) -> None:
        storage = self.tensor.untyped_storage()
        wanted = self.tensor.numel() * self.tensor.element_size()
        if storage.nbytes() != wanted:
            storage.resize_(wanted)

    def free(self) -> None:
        if self.resizable:
            self.tensor.untyped_storage().resize_(0)

    def detach(self) -> None:
        self.tensor = torch.empty(0, dtype=self.tensor.dtype, device=self.tensor.device)
