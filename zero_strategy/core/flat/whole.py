"""A FlatParam's whole values from its slices, and back: the one gather every caller that needs whole parameters
outside forward and backward uses (releasing the engine, a consolidated Fabric file), and the one cut of a whole
parameter into this rank's ranges (loading a full state dict, a released engine taking the module's values).

Both go through the Comm the FlatParam was handed (its shard group's), never through ``torch.distributed`` itself,
so the in-process harness, shared memory and the network all serve them. The gather is not the forward's: it
gathers any tensor laid out like this rank's slice (the fp32 master slice, or an optimizer state aligned to it),
in that tensor's dtype, into a buffer of its own, and leaves the FlatParam's state (SHARDED / UNSHARDED) alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.plan.layout import SliceOverlap


def gather_whole(flat: FlatParam, values: Tensor, label: str) -> Tensor:
    """Every rank's ``values`` (1-D, laid out like ``flat``'s slice) in rank order: the padded flat buffer, in
    ``values``' dtype, on the device the FlatParam gathers on. Collective over ``flat``'s shard group."""
    device = flat.full.device
    whole = torch.empty(flat.layout.padded_numel, dtype=values.dtype, device=device)
    flat.comm.all_gather(whole, values.to(device, copy=True), label).wait()
    return whole


def param_views(flat: FlatParam, whole: Tensor) -> Iterator[tuple[str, Tensor]]:
    """(name, that parameter's values shaped as the parameter: a view of ``whole``) for each of ``flat``'s
    parameters, in layout order."""
    for span in flat.layout.spans:
        yield span.name, whole[span.offset : span.end].view(span.shape)


def own_parts(flat: FlatParam, name: str, values: Tensor) -> Iterator[tuple[SliceOverlap, Tensor]]:
    """This rank's ranges of parameter ``name`` of ``flat``: (where the range sits, its elements cut from the
    parameter's whole ``values``). Local: nothing is exchanged."""
    flattened = torch.reshape(values, (-1,))  # a torch function: a lazily loaded tensor loads itself here
    for overlap in flat.layout.overlaps(flat.rank):
        if overlap.name == name:
            yield overlap, flattened[overlap.param_start : overlap.param_start + overlap.numel]
