"""Hybrid sharding's one set-up step: every shard group starts from the first group's values (see [Note: hybrid
sharding] in transport/topology.py). Each shard group broadcast its first rank's values while building its
FlatParams; this makes the replicas agree as well, so every rank of the run starts from global rank 0's values, as
under DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_strategy.core.flat_param import FlatParam
from zero_strategy.core.transport.choice import DistContext
from zero_strategy.core.transport.collectives import CommunicationLog, broadcast_flat


def adopt_first_replica(flats: list[FlatParam], ctx: DistContext, log: CommunicationLog) -> None:
    """Collective over each replica group: overwrite this rank's shards with those of its replica in the first
    shard group, then publish them to the module's parameters (stages 1/2 re-gather ``full``)."""
    if ctx.replicas is None or ctx.replicas.count == 1:
        return
    src = dist.get_global_rank(ctx.replicas.group, 0)
    with torch.no_grad():
        for flat in flats:
            if flat.shard.numel() > 0:
                broadcast_flat(flat.shard, src, ctx.replicas.group, log)
    for finish in [flat.start_publish_shard() for flat in flats]:
        finish()
