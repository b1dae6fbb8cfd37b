"""Hierarchical stage 3 (ZeRO++'s hpZ): a secondary, node-local copy of the compute-dtype parameters.

[Note: hierarchical parameters]
Flat stage 3 gathers every unit from the whole world before its forward and again before its backward, so with
ranks on several nodes both gathers cross the network. With ``hierarchical_params=K`` (K consecutive ranks, "node":
the ranks of one node) the fp32 masters, gradients and optimizer state stay sharded across the world (as flat stage
3: the optimizer step and the reduce-scatter are unchanged), and each rank also keeps 1/K of every unit's
compute-dtype parameters: the slice its position in its group of K would own. The copy is filled from the first
world gather of a unit after an optimizer step (that gather is needed anyway: the forward of the step's first
micro-step): this rank keeps its 1/K of the gathered buffer. Every later gather of the unit until the next step
(backward's re-gather, the forwards and backwards of further micro-steps, validation) gathers the copy inside the
group of K and never leaves the node. A step or a checkpoint load marks the copy stale.

Per rank and optimizer step (N ranks, G per node, K = G, Ψ the padded bytes of the gathered parameters, P those
of the reduced gradients, m micro-steps): flat stage 3 sends (N - G)/N × (2mΨ + mP) across nodes; hierarchical
(N - G)/N × (Ψ + mP): one world gather per step, the reduce-scatters unchanged. The price is Ψ/K bytes per rank,
kept for the whole run. Built eagerly right after the step instead, the copy would cost the same bytes but a
separate gather that nothing overlaps; filling it from the forward's gather needs no extra exchange at all.
Values are bit-identical to flat stage 3: the copy holds exactly the bytes the world gather delivered.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
from torch import Tensor

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.work import Work


class CopyState(Enum):
    """Whether the secondary copy holds the current parameters."""

    STALE = auto()  # from construction, a step or a load until a world gather refreshes it
    FRESH = auto()


class SecondaryCopy:
    """This rank's 1/K of one FlatParam's gathered (compute-dtype) buffer, sharded over the K ranks of ``comm``.

    Communication plan: nothing of its own; :meth:`keep_slice_of` copies from a world gather, :meth:`start_gather`
    all-gathers the copies of the K ranks of the group into ``full``."""

    values: Tensor  # 1-D, compute dtype, padded_numel / K elements: `full[rank·n : (rank+1)·n]` of the group

    def __init__(self, padded_numel: int, dtype: torch.dtype, device: torch.device, comm: Comm) -> None:
        if padded_numel % comm.size:  # layouts are padded to a multiple of the world size, which K divides
            raise AssertionError(f"a flat buffer of {padded_numel} elements does not split into {comm.size} slices")
        self.comm = comm
        self.values = torch.empty(padded_numel // comm.size, dtype=dtype, device=device)
        self.state = CopyState.STALE

    @property
    def fresh(self) -> bool:
        return self.state is CopyState.FRESH

    def keep_slice_of(self, full: Tensor) -> None:
        """``full`` was just gathered from the whole world: keep this rank's 1/K of it."""
        n = self.values.numel()
        with torch.no_grad():
            self.values.copy_(full[self.comm.rank * n : (self.comm.rank + 1) * n])
        self.state = CopyState.FRESH

    def mark_stale(self) -> None:
        """The shards changed (a step, a load): the next gather must come from the world again."""
        self.state = CopyState.STALE

    def start_gather(self, full: Tensor, label: str) -> Work:
        """Start gathering the K ranks' copies into ``full`` (inside the group: the node)."""
        if self.state is not CopyState.FRESH:
            raise RuntimeError(f"ZeRO: a stale secondary copy of {label} must not be gathered (a step or a load "
                               "changed the shards since it was filled)")
        return self.comm.all_gather(full, self.values, label)
