"""How one engine's bytes travel, decided once when it is built: the process group and this rank's place in it,
point-to-point exchanges or the backend's own collectives, shared-memory shards, and the watch over gathers that
go through the network. The rest of the core reads the decision from :class:`Transport`; nothing else looks at
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
from zero_strategy.core.transport.collectives import CommunicationLog, ProcessGroup, prefers_point_to_point
from zero_strategy.core.transport.gather_watch import GatherWatch
from zero_strategy.core.transport.shared_shards import SharedShards

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


def dist_context(group: ProcessGroup, collectives: str) -> DistContext:
    """This rank's place in ``group`` and whether gathers/reductions go point-to-point ("auto": on gloo)."""
    if dist.is_available() and dist.is_initialized():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        p2p = collectives == "point_to_point" or (collectives == "auto" and prefers_point_to_point(group))
        return DistContext(group, dist.get_rank(group), dist.get_world_size(group), src, p2p)
    return DistContext(None, 0, 1, 0)


def choose_shared_shards(
    ctx: DistContext, config: ZeroConfig, offloaded: bool, device: torch.device, model_bytes: int
) -> SharedShards | None:
    """Shared-memory shards (see [Note: shared-memory gathers]) where asked for or, with "auto", where they
    apply: stage 3, gloo, no offload, every rank on this host's CPU. Collective."""
    choice = config.collectives
    applies = (
        config.zero_stage.reshards_parameters
        and not offloaded
        and ctx.world_size > 1
        and choice in ("auto", "shared_memory")
        and (choice == "shared_memory" or prefers_point_to_point(ctx.group))
    )
    if not applies:  # an explicit "shared_memory" off stage 3 or with offload is refused by ZeroConfig already
        return None
    if SharedShards.usable(ctx.group, device, model_bytes):
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
    diverging gathers] in gather_watch.py). Shared-memory gathers are local copies and need no watch."""
    local = shared is not None and shared.connected
    if not reshards or local or ctx.world_size == 1:
        return None
    members = dist.get_process_group_ranks(ctx.group or dist.group.WORLD)  # groups share one store
    key = f"{next(_watch_numbers)}/{'-'.join(map(str, members))}"
    return GatherWatch(ctx.group, ctx.rank, ctx.world_size, key)


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
