"""Hybrid sharding's two exchanges between replicas (see [Note: hybrid sharding] in transport/topology.py).

At set-up every shard group starts from the first group's values: each shard group broadcast its first rank's
values while building its FlatParams; this makes the replicas agree as well, so every rank of the run starts from
global rank 0's values, as under DDP. At each optimizer step the replicas average their reduced gradient slices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_strategy.core.flat_param import FlatParam
from zero_strategy.core.transport.choice import DistContext
from zero_strategy.core.transport.collectives import (
    CommunicationLog,
    all_reduce_mean_over_replicas,
    broadcast_flat,
)


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


def average_over_replicas(flat: FlatParam) -> None:
    """Hybrid sharding: average ``flat``'s gradient slice accumulated since the last step over the replica group,
    once per optimizer step. Collective over the replicas; every replica has the same pieces (the same slice of the
    same layout), so they agree on calling it."""
    replicas = flat.ctx.replicas
    if not flat.replica_average_pending or replicas is None:
        return
    flat.replica_average_pending = False
    grads = [piece.grad for piece in flat.master_pieces if piece.grad is not None]
    assert len(grads) == len(flat.master_pieces), "every piece has a gradient after a reduction"
    # one exchange per FlatParam: the pieces' gradients side by side (a copy only when there are several)
    joined = grads[0] if len(grads) == 1 else torch.cat([grad.reshape(-1) for grad in grads])
    all_reduce_mean_over_replicas(joined, replicas, flat.log, flat.ctx.point_to_point)
    if len(grads) > 1:
        for grad, part in zip(grads, joined.split([grad.numel() for grad in grads]), strict=True):
            grad.copy_(part.view_as(grad))
