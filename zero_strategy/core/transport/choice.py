"""How one engine's bytes travel, decided once when it is built: the process group and this rank's place in it,
point-to-point exchanges or the backend's own collectives, host-wide shared parameters, and the watch over gathers
that go through the network. The rest of the core reads the decision from :class:`Transport`; nothing else looks at
the backend."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.transport import collectives
from zero_strategy.core.transport.collectives import (
    CommunicationLog,
    ProcessGroup,
    prefers_point_to_point,
)
from zero_strategy.core.transport.gather_watch import GatherWatch
from zero_strategy.core.transport.shared_exchange import ARENA_CAP_BYTES, ARENAS, SharedExchange, spin_sync_is_sound
from zero_strategy.core.transport.shared_shards import SharedShards
from zero_strategy.core.transport.topology import ParamGroup, RankLayout, Replicas, Topology, build_rank_layout

T = TypeVar("T")
_watch_numbers = itertools.count()  # one store namespace per engine (engines are built in the same order everywhere)


@dataclass(frozen=True, slots=True)
class DistContext:
    """Where a FlatParam lives: its process group, this rank and the world size."""

    group: ProcessGroup
    rank: int
    world_size: int
    src_rank: int  # global rank whose initial values every rank adopts (DDP broadcasts rank 0's too)
    point_to_point: bool = False  # all-gather / reduce-scatter as point-to-point exchanges (gloo: faster)
    replicas: Replicas | None = None  # hybrid sharding: the ranks owning the same slice in other shard groups
    everyone: ProcessGroup = None  # every rank of the run: `group`, or the world when there are replicas
    one_node: bool = True  # the topology puts every rank of `group` on one node
    param_group: ParamGroup | None = None  # hierarchical stage 3: the secondary copy's group, or None

    @property
    def everyone_src(self) -> int:
        """Global rank whose values every rank of ``everyone`` adopts (its first rank)."""
        return self.src_rank if self.replicas is None else 0

    @property
    def collective_device(self) -> torch.device:
        """Where tensors handed to this group's collectives live (see [Note: collectives run on the group's
        device] in collectives.py): this rank's CUDA device on NCCL, the CPU on gloo."""
        return collectives.collective_device(self.group)


def rank_layout(group: ProcessGroup | RankLayout, config: ZeroConfig) -> RankLayout:
    """The engine's layout: given, or built from ``config.shard_group_size`` and the launcher's environment
    (``LOCAL_WORLD_SIZE``; see [Note: node membership comes from the launcher] in topology.py)."""
    if isinstance(group, RankLayout):
        return group
    if not (dist.is_available() and dist.is_initialized()):
        return RankLayout(Topology.one_node(1), group)
    layered = config.shard_group_size is not None or config.hierarchical_params is not None
    if layered and group is not None:
        raise ZeroConfigError(
            "shard_group_size and hierarchical_params build their groups from the whole world; with a process "
            "group of your own pass group=build_rank_layout(...) (zero_strategy.core.transport.topology) instead."
        )
    if layered:
        return build_rank_layout(config.shard_group_size, hierarchical_params=config.hierarchical_params)
    return RankLayout(Topology.from_env(dist.get_world_size()), group)


def dist_context(layout: RankLayout, collectives: str) -> DistContext:
    """This rank's place in its shard group and whether gathers/reductions go point-to-point ("auto": on gloo)."""
    group = layout.shard_group
    if dist.is_available() and dist.is_initialized():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        p2p = collectives == "point_to_point" or (collectives == "auto" and prefers_point_to_point(group))
        members = dist.get_process_group_ranks(group or dist.group.WORLD)
        everyone = group if layout.replicas is None else None
        one_node = layout.topology.one_node_holds(members)
        return DistContext(
            group, dist.get_rank(group), dist.get_world_size(group), src, p2p, layout.replicas, everyone, one_node,
            layout.param_group,
        )
    return DistContext(None, 0, 1, 0)


def choose_shared_shards(
    ctx: DistContext, config: ZeroConfig, offloaded: bool, device: torch.device, model_bytes: int
) -> SharedShards | None:
    """Host-wide shared parameters (see [Note: shared-memory gathers]) where asked for or, with "auto", where they
    apply: stage 3, gloo, no offload, every rank of the shard group on one node (per the launcher's topology) and on
    this host's CPU. Collective."""
    choice = config.collectives
    applies = (
        config.zero_stage.reshards_parameters
        and not offloaded
        and ctx.world_size > 1
        and choice in ("auto", "shared_memory")
        and (choice == "shared_memory" or (prefers_point_to_point(ctx.group) and ctx.one_node))
    )
    if not applies:  # an explicit "shared_memory" off stage 3 or with offload is refused by ZeroConfig already
        return None
    if ctx.one_node and SharedShards.usable(ctx.group, device, model_bytes):
        return SharedShards(ctx.group, ctx.rank, ctx.world_size, ctx.src_rank)
    if choice == "shared_memory":
        raise ZeroConfigError(
            'collectives="shared_memory" needs every rank on one host, computing on its CPU, and room in '
            f'/dev/shm for {model_bytes / 2**20:.0f} MiB of shards; use "auto" or "point_to_point".'
        )
    return None


def shared_memory_unavailable(config: ZeroConfig, reason: str) -> None:
    """Every rank gets here together (the failure was agreed in ``connect``); gathers use the network."""
    if config.collectives == "shared_memory":
        raise ZeroConfigError(
            f'collectives="shared_memory": {reason}; free or enlarge /dev/shm (docker run --shm-size=...), or '
            'use "auto" or "point_to_point".'
        )
    warnings.warn(f"ZeRO stage 3: shared-memory gathers unavailable ({reason}); using point-to-point gathers.",
                  stacklevel=4)


def choose_gather_watch(ctx: DistContext, reshards: bool, shared: SharedShards | None) -> GatherWatch | None:
    """Stage 3 gathering through the network: watch for ranks that gather different units (see [Note:
    diverging gathers] in gather_watch.py). Parameters read in place from shared memory need no watch."""
    local = shared is not None and shared.connected
    if not reshards or local or ctx.world_size == 1:
        return None
    if ctx.collective_device.type != "cpu":
        # The watch waits in a thread of its own, and its per-step check reads a result back to the host: on a GPU
        # the first would wait on the wrong thread's stream and the second would synchronise every step. There a
        # diverging gather ends with NCCL's own timeout (process_group_timeout_s) instead.
        return None
    members = dist.get_process_group_ranks(ctx.group or dist.group.WORLD)  # groups share one store
    key = f"{next(_watch_numbers)}/{'-'.join(map(str, members))}"
    return GatherWatch(ctx.group, ctx.rank, ctx.world_size, key)


def choose_shared_exchange(
    ctx: DistContext, config: ZeroConfig, device: torch.device, watch: GatherWatch | None, flat_bytes: list[int]
) -> SharedExchange | None:
    """Shared-memory gradient reductions (see [Note: shared-memory reductions] in shared_exchange.py) where they
    apply: "auto" on gloo or "shared_memory", every rank of the shard group on this host's CPU, an x86-64
    processor, and no network gathers at stage 3 (``watch``). ``flat_bytes``: each trainable FlatParam's flattened
    gradient in bytes (the arenas fit the largest one under the cap). Collective."""
    choice = config.collectives
    wanted = choice == "shared_memory" or (choice == "auto" and prefers_point_to_point(ctx.group))
    fitting = [nbytes for nbytes in flat_bytes if nbytes <= ARENA_CAP_BYTES]
    if not wanted or ctx.world_size == 1 or watch is not None or not fitting:
        return None
    explicit = choice == "shared_memory" and not config.zero_stage.reshards_parameters  # nothing else is shared
    arena_bytes = max(fitting)
    reason = f"/dev/shm has no room for {ARENAS * arena_bytes * ctx.world_size / 2**20:.0f} MiB of reduction buffers"
    if not ctx.one_node or not spin_sync_is_sound():
        if explicit:
            why = ("its ranks are not all on one node" if not ctx.one_node else
                   "this processor is not x86-64, whose store ordering the shared reduction counters rely on")
            raise ZeroConfigError(f'collectives="shared_memory" at stage {config.stage}: {why}; use "auto" or '
                                  '"point_to_point".')
        return None
    if SharedExchange.usable(ctx.group, device, arena_bytes, ctx.world_size):
        exchange = SharedExchange(
            ctx.group, ctx.rank, ctx.world_size, ctx.src_rank, arena_bytes, config.process_group_timeout_s
        )
        if exchange.connect():  # agreed by every rank
            return exchange
        reason = exchange.failure or "a rank could not map a peer's buffers"
    if explicit:
        raise ZeroConfigError(
            f'collectives="shared_memory": {reason}. It needs every rank on one host, computing on its CPU; free or '
            'enlarge /dev/shm (docker run --shm-size=...), or use "auto" or "point_to_point".'
        )
    warnings.warn(f"ZeRO: shared-memory gradient reductions unavailable ({reason}); reducing point-to-point.",
                  stacklevel=3)
    return None


@dataclass(slots=True)
class Transport:
    """What an engine decided about moving bytes; FlatParams and hooks read it, never the backend."""

    ctx: DistContext
    log: CommunicationLog
    shared: SharedShards | None = None
    watch: GatherWatch | None = None

    def collective(self, what: str, collective: Callable[[], T]) -> T:
        """Run one of the engine's blocking collectives between gathers, watched where gathers are."""
        return collective() if self.watch is None else self.watch.call(what, collective)
