"""Where one FlatParam's bytes live: its gathered buffer, this rank's master slice, and what offload adds.

Variants, all decided when the FlatParam is built and held here as one object:
- the gathered buffer (``full``): private and kept (stages 1/2), private and freed between gathers (stage 3), or
  host-wide and read in place (stage 3 on one host's CPU ranks; see core/flat/full_buffer.py);
- the master slice (``shard``, the parameters' own dtype, fp32 under mixed precision): a view of ``full``'s own
  slice where that loses nothing (same dtype, never freed, not offloaded: this saves a copy of 1/N of the model),
  else memory of its own on the compute device, in (pinned) host memory or in a file (offload, see placement.py);
- with offloaded masters but parameters on a GPU, a compute-dtype copy of the slice on the device, so a gather needs
  no host-to-device copy (refreshed after every step);
- with nvme offload, a file for the reduced gradient slice (see [Note: gradient slices in files]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from zero_strategy.config import OffloadDevice
from zero_strategy.core.comm.streams import copy_host_to_device, host_to_device
from zero_strategy.core.flat.full_buffer import FullBuffer, PrivateFull
from zero_strategy.core.flat.placement import Placement
from zero_strategy.core.plan.flat_specs import FlatSpec


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """How the FlatParams of one engine store their bytes."""

    keeps_full: bool  # stages 1/2: the gathered buffer is never freed
    device: torch.device  # the compute device (where meta parameters get storage, too)
    placement: Placement | None = None  # offload; None: next to the gathered buffer


class FlatStorage:
    """The buffers of one FlatParam (see the module docstring)."""

    full: FullBuffer
    shard: Tensor  # 1-D, the parameters' own dtype: this rank's master slice, the source of truth
    shard_aliases_full: bool  # `shard` is a view of `full`'s own slice
    device_source: Tensor | None  # offloaded masters, parameters on a GPU: the slice in the compute dtype there
    grad_file: Tensor | None  # nvme offload: the reduced gradient slice's file

    def __init__(
        self,
        spec: FlatSpec,
        rank: int,
        initial: Tensor | None,
        options: StorageOptions,
        host_full: FullBuffer | None = None,
    ) -> None:
        """``initial``: the parameters' values laid out flat (padded, their own dtype), the same on every rank; None
        when they arrive later (sharded construction, see core/init/materialize.py). ``host_full``: a host-wide gathered
        buffer from the engine's comms (EngineComms), or None."""
        self.spec = spec
        self.placement = options.placement
        start, end = spec.layout.shard_range(rank)
        self.own_range = (start, end)
        stored, compute = spec.stored_dtype, spec.compute_dtype
        own = initial[start:end] if initial is not None else torch.zeros(end - start, dtype=stored,
                                                                         device=options.device)
        placement = self.placement
        if host_full is not None:  # see [Note: shared-memory gathers]
            self.full = host_full
            host_full.tensor[start:end].copy_(own)
            # fp32: our slice of the host's buffer is the master slice; else the masters stay private
            self.shard_aliases_full = compute == stored and placement is None
            self.shard = host_full.tensor[start:end] if self.shard_aliases_full else own.clone()
        else:
            self.full = PrivateFull(self._private_full(spec, initial, options), resizable=not options.keeps_full)
            self.shard_aliases_full = options.keeps_full and compute == stored and placement is None
            if self.shard_aliases_full:
                self.shard = self.full.tensor[start:end]
            elif placement is not None:  # offloaded: the slice lives in host memory or a file
                self.shard = placement.shard_buffer(f"shard-{id(self)}", end - start, stored)
                self.shard.copy_(own)
            else:
                self.shard = own.clone()
        # [Note: gradient slices in files]
        # With nvme optimizer offload the reduced gradient slices (4Ψ/N bytes, the largest thing left in host
        # memory) go to a file of their own, reused every step: after each unit's reduction its pages are released,
        # and the chunked optimizer step maps them back chunk by chunk, like the masters and the optimizer state.
        self.grad_file = None
        if placement is not None and placement.store is not None and placement.optimizer is OffloadDevice.nvme:
            self.grad_file = placement.shard_buffer(f"grad-{id(self)}", self.shard.numel(), stored)
        self.device_source = None
        device = self.full.tensor.device
        if (placement is not None and not options.keeps_full and placement.keeps_device_gather_source
                and self.shard.device != device):
            self.device_source = self.shard.to(device=device, dtype=compute)

    @staticmethod
    def _private_full(spec: FlatSpec, initial: Tensor | None, options: StorageOptions) -> Tensor:
        """The gathered buffer in the compute dtype: the initial values (converted), or, before values exist, a
        buffer of the full size whose pages are never touched at stage 3 (its storage is freed right away) and zeros
        at stages 1/2 (where the values are written into it)."""
        numel, compute = spec.layout.padded_numel, spec.compute_dtype
        if initial is not None:
            return initial if initial.dtype == compute else initial.to(compute)
        if options.keeps_full:
            return torch.zeros(numel, dtype=compute, device=options.device)
        return torch.empty(numel, dtype=compute, device=options.device)

    # ------------------------------------------------------------------------------------------- reading
    def gather_source(self) -> Tensor:
        """This rank's slice in the compute dtype, on the compute device (the input of a gather)."""
        if self.device_source is not None:
            return self.device_source
        full = self.full.tensor
        return host_to_device(self.shard, full.device, full.dtype)  # without blocking the host

    def own_slice_of_full(self) -> Tensor:
        return self.full.tensor[self.own_range[0] : self.own_range[1]]

    # ------------------------------------------------------------------------------------------- writing
    def write_own_slice(self) -> None:
        """A host-wide buffer whose slice is not the master itself: write the (rounded) masters into it."""
        if self.full.readable_in_place and not self.shard_aliases_full:
            self.own_slice_of_full().copy_(self.shard)

    def refresh_device_source(self) -> None:
        """After a step on offloaded masters: update the device-side compute copy."""
        if self.device_source is not None:
            copy_host_to_device(self.device_source, self.shard)

    def after_host_read(self) -> None:
        """A gather or a step read file-backed slices: let their pages go (see [Note: nvme offload])."""
        if self.placement is not None:
            self.placement.after_host_read()

    def own_shard(self) -> Tensor:
        """Give the master slice memory of its own (it may be a view of ``full`` or of a host-wide buffer, both
        dropped when the engine lets the module go); returns the new slice."""
        self.shard = self.shard.clone()
        self.shard_aliases_full = False
        return self.shard

    def detach_full(self) -> None:
        """The engine lets the module go: forget the gathered buffer (a host-wide one is unmapped with its last
        view)."""
        self.full.detach()
