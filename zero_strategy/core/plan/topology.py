"""Where ranks sit: the node of every rank, and the hybrid layout (shard groups of K ranks, replicas across them).

[Note: node membership comes from the launcher]
A node is what the launcher says it is (torchrun's ``GROUP_RANK`` / ``LOCAL_WORLD_SIZE``, Lightning's cluster
environment ``node_rank`` / ``num_nodes``), never the hostname: two "nodes" started on one host (as the tests do)
behave as two nodes, and per-link byte counts and the hybrid layout follow the launcher's picture. Launchers place
ranks node by node (global rank = node rank × ranks per node + local rank), so the layout is ``ranks_per_node``.

[Note: hybrid sharding]
``shard_group_size=K`` splits the world into ``world / K`` shard groups of K consecutive ranks (with K = the ranks
of a node, a shard group is a node). Inside a group everything is ZeRO as with a world of K ranks: each rank owns
1/K of every unit. Rank i of every group owns the same slice, so the ranks with the same position form a replica
group. The in-group reduce-scatters accumulate into the slice's fp32 gradient as in flat ZeRO; before the optimizer
step (``ZeroEngine.reduce_pending``, before clipping or the overflow check read it) the accumulated slice is
averaged over its replica group, one all-reduce per FlatParam and step whatever the number of micro-steps (the
mean is linear, so averaging the sum equals summing the averages), which gives every replica the mean over the
whole world, and the replicas then step identically. Parameters are gathered only inside a group. Per rank and
step the inter-node traffic is then the replica all-reduce of 1/K of the fp32 gradients instead of a share of every
gather and reduce-scatter.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zero_strategy.config import ZeroConfig, ZeroConfigError

INTRA_NODE = "intra_node"
INTER_NODE = "inter_node"
LINKS = (INTRA_NODE, INTER_NODE)


@dataclass(frozen=True, slots=True)
class Topology:
    """The node of every global rank (see [Note: node membership comes from the launcher])."""

    node_of_rank: tuple[int, ...]  # global rank → node index

    @classmethod
    def one_node(cls, world_size: int) -> Topology:
        return cls((0,) * world_size)

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int) -> Topology:
        """``world_size`` ranks placed node by node, ``ranks_per_node`` on each."""
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ZeroConfigError(
                f"{world_size} ranks cannot sit {ranks_per_node} per node: the launcher must start the same number "
                "of processes on every node."
            )
        return cls(tuple(rank // ranks_per_node for rank in range(world_size)))

    @classmethod
    def from_env(cls, world_size: int) -> Topology:
        """From torchrun's ``LOCAL_WORLD_SIZE`` (ranks on this rank's node) when set, else one node."""
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit() or int(local) < 1 or world_size % int(local):
            return cls.one_node(world_size)
        return cls.uniform(world_size, int(local))

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of_rank))

    def ranks_per_node(self) -> int:
        """Ranks of the first node (launchers start the same number everywhere)."""
        return self.node_of_rank.count(self.node_of_rank[0]) if self.node_of_rank else 1

    def link(self, rank: int, peer: int) -> str:
        """``INTRA_NODE`` or ``INTER_NODE`` between two global ranks."""
        return INTRA_NODE if self.node_of_rank[rank] == self.node_of_rank[peer] else INTER_NODE

    def one_node_holds(self, ranks: list[int]) -> bool:
        return len({self.node_of_rank[rank] for rank in ranks}) <= 1


def resolve_shard_group_size(value: int | str | None, topology: Topology, key: str = "shard_group_size") -> int:
    """``shard_group_size`` (or ``hierarchical_params``: ``key``) as a number of ranks: None → the whole world,
    "node" → the ranks of one node. Raises :class:`ZeroConfigError` when it does not divide the world (before any
    training)."""
    world = topology.world_size
    if value is None:
        return world
    size = topology.ranks_per_node() if value == "node" else value
    if not isinstance(size, int) or size < 1 or world % size:
        raise ZeroConfigError(
            f"{key}={value!r} must divide the world size {world} ({topology.num_nodes} node(s)): use a "
            f"divisor of {world}, 'node' (ranks of one node) or None (the whole world)."
        )
    return size


@dataclass(frozen=True, slots=True)
class Replicas:
    """This rank's replica group: the ranks of the other shard groups that own the same slice."""

    group: dist.ProcessGroup
    count: int  # number of shard groups (replicas of each slice)
    index: int  # which shard group this rank belongs to (0: the one that writes checkpoints)


@dataclass(frozen=True, slots=True)
class ParamGroup:
    """Hierarchical stage 3: the K consecutive ranks among which the secondary parameter copy is sharded (see
    [Note: hierarchical parameters] in core/flat/secondary.py)."""

    group: dist.ProcessGroup
    rank: int  # this rank's position in the group: which 1/K of every unit it keeps
    size: int  # K


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """This rank's tensor-parallel group: the ranks holding the other blocks of its DTensor parameters (see [Note:
    ZeRO over the data-parallel dimension of a 2-D mesh] in plan/tensor_parallel.py)."""

    group: dist.ProcessGroup
    rank: int  # this rank's coordinate on the tensor_parallel dimension
    size: int


@dataclass(frozen=True, slots=True)
class RankLayout:
    """What an engine needs to know about where its ranks sit. Pass it as ``ZeroEngine(..., group=layout)``."""

    topology: Topology
    shard_group: dist.ProcessGroup | None  # the ranks that share one copy of the sharded state (None: the world)
    replicas: Replicas | None = None  # None: a single shard group (flat ZeRO)
    param_group: ParamGroup | None = None  # hierarchical stage 3's secondary group; None: off
    # a 2-D mesh: shard_group is then the data-parallel group; None: no tensor parallelism
    tensor_parallel: TensorParallelGroup | None = None


def build_param_group(hierarchical_params: int | str | None, topology: Topology) -> ParamGroup | None:
    """Collective over the default process group: this rank's secondary group of K consecutive ranks. None when
    off, when K is the whole world or when every rank sits on one node: then the world gather never leaves the
    node anyway, so a secondary copy would cost memory and save nothing."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = resolve_shard_group_size(hierarchical_params, topology, "hierarchical_params")
    if hierarchical_params is None or size == world or topology.num_nodes == 1:
        return None
    members = [list(range(g * size, (g + 1) * size)) for g in range(world // size)]
    if not all(topology.one_node_holds(ranks) for ranks in members):  # correct, but saves nothing: say so
        warnings.warn(
            f"hierarchical_params={hierarchical_params!r}: groups of {size} ranks span nodes "
            f"({topology.ranks_per_node()} rank(s) per node), so the gathers from the secondary copies cross nodes "
            "too; use 'node' or a divisor of the ranks per node.",
            stacklevel=3,
        )
    groups = [dist.new_group(ranks) for ranks in members]
    return ParamGroup(groups[rank // size], rank % size, size)


def build_rank_layout(
    shard_group_size: int | str | None,
    topology: Topology | None = None,
    hierarchical_params: int | str | None = None,
) -> RankLayout:
    """Collective over the default process group (every rank calls it, in the same order): the shard group and
    replica group of this rank (see [Note: hybrid sharding]), or the secondary group of hierarchical stage 3."""
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = topology or Topology.from_env(world)
    if topology.world_size != world:
        raise ZeroConfigError(f"the topology describes {topology.world_size} ranks but the world has {world}.")
    size = resolve_shard_group_size(shard_group_size, topology)
    if size == world:
        return RankLayout(topology, None, None, build_param_group(hierarchical_params, topology))
    count = world // size
    # every rank creates every group, in the same order (torch requires it of new_group)
    shard_groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(count)]
    replica_groups = [dist.new_group(list(range(i, world, size))) for i in range(size)]
    return RankLayout(topology, shard_groups[rank // size], Replicas(replica_groups[rank % size], count, rank // size))


def resolve_rank_layout(group: Any, config: ZeroConfig) -> RankLayout:
    """An engine's layout: given, or built from ``config.shard_group_size`` / ``hierarchical_params`` and the
    launcher's environment (``LOCAL_WORLD_SIZE``; see [Note: node membership comes from the launcher])."""
    if isinstance(group, RankLayout):
        return group
    if group is not None and not isinstance(group, dist.ProcessGroup):  # simulated ranks (comm/in_process.py)
        return RankLayout(Topology.one_node(len(group.members)), group)  # type: ignore[arg-type]
    if not (dist.is_available() and dist.is_initialized()):
        return RankLayout(Topology.one_node(1), group)
    layered = config.shard_group_size is not None or config.hierarchical_params is not None
    if layered and group is not None:
        raise ZeroConfigError(
            "shard_group_size and hierarchical_params build their groups from the whole world; with a process "
            "group of your own pass group=build_rank_layout(...) (zero_strategy.core.plan.topology) instead."
        )
    if layered:
        return build_rank_layout(config.shard_group_size, hierarchical_params=config.hierarchical_params)
    return RankLayout(Topology.from_env(dist.get_world_size()), group)
