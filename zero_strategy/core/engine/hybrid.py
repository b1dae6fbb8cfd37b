"""Hybrid sharding's two exchanges between replicas (see [Note: hybrid sharding] in plan/topology.py).

At set-up every shard group starts from the first group's values: each shard group broadcast its first rank's
values while building its FlatParams; this makes the replicas agree as well, so every rank of the run starts from
global rank 0's values, as under DDP. At each optimizer step the replicas average their reduced gradient slices.
"""

from __future__ import annotations

import torch

from zero_strategy.core.comm.comm import ReduceOp
from zero_strategy.core.comm.engine_comms import ReplicaComm
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.grads import SliceState


def adopt_first_replica(flats: list[FlatParam], replicas: ReplicaComm) -> None:
    """Collective over each replica group: overwrite this rank's slices with those of its replica in the first
    shard group, then publish them to the module's parameters (stages 1/2 re-gather the full buffer)."""
    if replicas.count == 1:
        return
    with torch.no_grad():
        for flat in flats:
            if flat.shard.numel() > 0:
                replicas.comm.broadcast(flat.shard, 0, f"first replica's {flat.label}").wait()
    for work in [flat.start_publish() for flat in flats]:
        work.wait()


def average_over_replicas(flat: FlatParam, replicas: ReplicaComm) -> None:
    """Average ``flat``'s gradient slice accumulated since the last step over the replica group, once per
    optimizer step. Collective over the replicas; every replica has the same pieces (the same slice of the same
    layout), so they agree on calling it."""
    if flat.grads.slice_state is not SliceState.LOCAL:
        return
    grads = [piece.grad for piece in flat.master_pieces if piece.grad is not None]
    assert len(grads) == len(flat.master_pieces), "every piece has a gradient after a reduction"
    # one exchange per FlatParam: the pieces' gradients side by side (a copy only when there are several)
    joined = grads[0] if len(grads) == 1 else torch.cat([grad.reshape(-1) for grad in grads])
    replicas.comm.all_reduce(joined, ReduceOp.MEAN, f"replica average of {flat.label}").wait()
    if len(grads) > 1:
        for grad, part in zip(grads, joined.split([grad.numel() for grad in grads]), strict=True):
            grad.copy_(part.view_as(grad))
    flat.grads.slice_state = SliceState.FINAL
