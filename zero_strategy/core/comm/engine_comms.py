"""An engine's Comms (:class:`EngineComms`): how its bytes move, chosen once, when the engine is built.

This is the only reader of the ``collectives`` option, the backend, the compute device, the processor, the room in
``/dev/shm`` and the arena cap, and the only place that warns about or refuses a transport. It builds one Comm per
group (shard group, replicas, every rank of the run, hierarchical stage 3's node-local group) and hands them out;
FlatParams, units, hooks and the step call the Comm they were handed, never a transport by name.

[Note: the choices]
- network transport per group: ``"native"`` the backend's collectives; ``"point_to_point"`` isend/irecv
  exchanges; ``"auto"``/``"shared_memory"``: point-to-point on gloo (measured faster, see [Note: why point-to-point
  on gloo]), native elsewhere (NCCL's collectives are already optimal). A group of one rank: local copies.
- host-wide parameters (stage 3, no offload, every rank of the shard group on this host's CPU, room in /dev/shm):
  each stage-3 FlatParam's gathered buffer once per host, read in place (see [Note: shared-memory gathers]).
- the divergence watch: stage 3 gathering through the network on CPU ranks (see [Note: diverging gathers]). Not on
  a GPU: its waiter thread would wait on the wrong thread's stream and its per-step check would synchronise every
  step; there a diverging gather ends with NCCL's own timeout (process_group_timeout_s) instead.
- shared-memory exchanges (reductions, stages 1/2's gathers, small all-reduces, barriers): "auto" on gloo or
  "shared_memory", every rank of the shard group on this host's CPU, an x86-64 processor, no watch, and only for
  the FlatParams whose exchanges fit ``ARENA_CAP_BYTES``; the others use the network transport.
- CUDA side streams around the gathers and reductions of every group whose compute device is a GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.group import Group
from zero_strategy.core.comm.host_segments import HostSegments, HostSharedFull, free_bytes
from zero_strategy.core.comm.in_process import InProcessComm, InProcessGroup
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.comm.native import NativeComm
from zero_strategy.core.comm.point_to_point import PointToPointComm
from zero_strategy.core.comm.shared_memory import SharedMemoryComm
from zero_strategy.core.comm.shm_exchange import ARENAS, SharedExchange, spin_sync_is_sound
from zero_strategy.core.comm.solo import SoloComm
from zero_strategy.core.comm.streams import CollectiveStreams, StreamedComm
from zero_strategy.core.comm.watched import WatchedComm
from zero_strategy.core.once import first_time
from zero_strategy.core.plan.flat_specs import FlatSpec
from zero_strategy.core.plan.topology import RankLayout

__all__ = ["ARENAS", "ARENA_CAP_BYTES", "EngineComms", "ReplicaComm", "local_comm", "network_comm", "watch_applies"]

ARENA_CAP_BYTES = 256 * 2**20
"""Largest FlatParam exchanged through shared memory (each rank holds ``ARENAS`` arenas of this size at most: they
would cost that many copies of a larger one for the whole run)."""
_ROOM_TO_SPARE = 5 / 4  # /dev/shm must hold what we put there with a quarter to spare


@dataclass(frozen=True, slots=True)
class ReplicaComm:
    """Hybrid sharding: this rank's replica group (the ranks of the other shard groups owning the same slice)."""

    comm: Comm
    count: int  # replicas of each slice (shard groups)
    index: int  # which shard group this rank belongs to (0: the one that writes checkpoints)


def local_comm(log: CommunicationLog) -> Comm:
    """A Comm over this process alone (a group of one rank, whatever the world): for work only this process does,
    such as writing a checkpoint of a module no engine holds."""
    return SoloComm(Group(None, 0, 1, (0,), torch.device("cpu")), log)


def network_comm(handle: dist.ProcessGroup | InProcessGroup | None, collectives: str, log: CommunicationLog) -> Comm:
    """The network transport of one group (see [Note: the choices])."""
    group = Group.of(handle)
    if group.size == 1:
        return SoloComm(group, log)
    if isinstance(handle, InProcessGroup):  # ranks simulated by threads (logic tests)
        return InProcessComm(group, log)
    point_to_point = collectives == "point_to_point" or (collectives != "native" and group.backend == "gloo")
    return PointToPointComm(group, log) if point_to_point else NativeComm(group, log)


class EngineComms:
    """Every Comm of one engine, chosen once (see [Note: the choices]). Building it is collective."""

    def __init__(
        self, config: ZeroConfig, layout: RankLayout, device: torch.device, offloaded: bool, log: CommunicationLog
    ) -> None:
        self.config = config
        self.log = log
        self.device = device
        self.offloaded = offloaded
        self.network = network_comm(layout.shard_group, config.collectives, log)
        self.group = self.network.group
        self.one_node = layout.topology.one_node_holds(list(self.group.members))
        self._world = None if layout.replicas is None else network_comm(None, config.collectives, log)
        self.replicas: ReplicaComm | None = None
        if layout.replicas is not None:
            replica_comm = network_comm(layout.replicas.group, config.collectives, log.prefixed("replica_"))
            self.replicas = ReplicaComm(replica_comm, layout.replicas.count, layout.replicas.index)
        # CUDA: the side streams of the compute device (see [Note: streams for gathers and reductions])
        self.streams = CollectiveStreams.for_device(device) if device.type == "cuda" else None
        self.secondary: Comm | None = None
        if layout.param_group is not None:
            self.secondary = self._streamed(network_comm(layout.param_group.group, config.collectives, log))
        # tensor parallelism: the few exchanges that cross the TP dimension (see [Note: ZeRO over the data-parallel
        # dimension of a 2-D mesh] in plan/tensor_parallel.py); None without it
        self.tensor: Comm | None = None
        if layout.tensor_parallel is not None and layout.tensor_parallel.size > 1:
            self.tensor = network_comm(layout.tensor_parallel.group, config.collectives, log.prefixed("tensor_"))
        self.host_shared = False  # stage 3's gathered buffers are host-wide (set by host_shared_buffers)
        self._shared: SharedMemoryComm | None = None
        self._watched: Comm | None = None

    # ------------------------------------------------------------------------------------------ building
    def host_shared_buffers(self, specs: Sequence[FlatSpec]) -> list[HostSharedFull] | None:
        """Stage 3's gathered buffers once per host, one per spec (every rank reserving its own slice), where they
        apply (see [Note: the choices]); None: gathers go through the network. Collective."""
        config, choice = self.config, self.config.collectives
        applies = (
            config.zero_stage.reshards_parameters and not self.offloaded and self.group.size > 1 and specs
            and choice in ("auto", "shared_memory")
            and (choice == "shared_memory" or (self.group.backend == "gloo" and self.one_node))
        )
        if not applies:  # an explicit "shared_memory" with offload is refused by ZeroConfig already
            return None
        needed = sum(spec.gather_bytes for spec in specs)
        available = free_bytes()
        room = self.device.type == "cpu" and available >= needed * _ROOM_TO_SPARE
        if not (self.one_node and _everyone(self.network, room) and HostSegments.same_host(self.network)):
            why = (f"it needs every rank of the shard group on one host computing on its CPU and "
                   f"{_size(needed * _ROOM_TO_SPARE)} free in /dev/shm ({_size(available)} free here)")
            self._unavailable("gathers", why)
            return None
        segments = HostSegments(self.network)
        buffers: list[HostSharedFull | None] = []
        try:
            for spec in specs:
                own = spec.layout.shard_range(self.group.rank)
                buffers.append(segments.allocate_full(spec.layout.padded_numel, spec.compute_dtype, own))
        except BaseException:
            segments.discard_files()  # a failed set-up leaves nothing in /dev/shm
            raise
        if not segments.connect() or any(buffer is None for buffer in buffers):
            self._unavailable("gathers", segments.failure or "a rank could not reserve its buffers")
            return None
        self.host_shared = True
        return [buffer for buffer in buffers if buffer is not None]

    def finish(self, trainable: Sequence[FlatSpec]) -> None:
        """After the parameters' buffers: the watch, the shared-memory exchanges (sized for ``trainable``'s
        reductions and gathers) and the streams of the shard group. Collective."""
        network = self.network
        if watch_applies(self.config.zero_stage.reshards_parameters, self.host_shared, self.group):
            network = self._watched = WatchedComm(network)
        self.network = self._streamed(network)
        self._shared = self._shared_exchanges(trainable)

    def _streamed(self, comm: Comm) -> Comm:
        if self.streams is None or comm.size == 1:
            return comm
        return StreamedComm(comm, self.streams)

    def _shared_exchanges(self, trainable: Sequence[FlatSpec]) -> SharedMemoryComm | None:
        choice = self.config.collectives
        wanted = choice == "shared_memory" or (choice == "auto" and self.group.backend == "gloo")
        sizes = [max(spec.reduce_bytes, spec.gather_bytes) for spec in trainable]
        fitting = [size for size in sizes if size <= ARENA_CAP_BYTES]
        if not wanted or self.group.size == 1 or self._watched is not None or not fitting:
            return None
        explicit = choice == "shared_memory" and not self.config.zero_stage.reshards_parameters
        if not self.one_node or not spin_sync_is_sound():
            if explicit:
                why = ("its ranks are not all on one node" if not self.one_node else
                       "this processor is not x86-64, whose store ordering the shared counters rely on")
                raise ZeroConfigError(f'collectives="shared_memory" at stage {self.config.stage}: {why}; use '
                                      '"auto" or "point_to_point".')
            return None
        arena_bytes = max(fitting)
        needed = self.group.size * ARENAS * arena_bytes
        room = self.device.type == "cpu" and free_bytes() >= needed * _ROOM_TO_SPARE
        reason = (f"/dev/shm has {_size(free_bytes())} free; the reduction buffers need "
                  f"{_size(needed * _ROOM_TO_SPARE)}")
        if _everyone(self.network, room) and HostSegments.same_host(self.network):
            exchange = SharedExchange(self.network, arena_bytes, self.config.process_group_timeout_s, self.log)
            if exchange.connect():  # agreed by every rank
                return SharedMemoryComm(exchange, self.network)
            reason = exchange.failure or "a rank could not map a peer's buffers"
        if explicit:
            raise ZeroConfigError(
                f'collectives="shared_memory": {reason}. It needs every rank on one host, computing on its CPU; free '
                'or enlarge /dev/shm (docker run --shm-size=...), or use "auto" or "point_to_point".'
            )
        self._unavailable("reductions", reason)
        return None

    def _unavailable(self, what: str, reason: str) -> None:
        """Shared memory does not apply although asked for or preferred (every rank gets here together)."""
        if self.config.collectives == "shared_memory":
            raise ZeroConfigError(
                f'collectives="shared_memory": {reason}; free or enlarge /dev/shm (docker run --shm-size=...), or '
                'use "auto" or "point_to_point".'
            )
        if self.config.collectives != "auto" or self.group.backend != "gloo" or not self.one_node:
            return  # never preferred here: nothing to say
        message = (f"ZeRO: shared-memory {what} unavailable ({reason}); using point-to-point {what} through the "
                   "network (each rank then holds the units it gathers in its own memory: `zero-estimate ... "
                   "--collectives point_to_point` gives the memory per rank).")
        if first_time(("shared-memory fallback", message)):  # once per process (see [Note: once per process])
            warnings.warn(message, stacklevel=4)

    # --------------------------------------------------------------------------------------------- use
    @property
    def everyone(self) -> Comm:
        """Every rank of the run: the shard group, or the whole world with replicas (hybrid sharding)."""
        return self.shard if self._world is None else self._world

    @property
    def shard(self) -> Comm:
        """The shard group's Comm for the step's small exchanges and barriers (through shared memory where it
        applies)."""
        return self._shared or self.network

    def for_flat(self, spec: FlatSpec) -> Comm:
        """The Comm a FlatParam gathers and reduces through: shared memory where its exchanges fit, else the
        network."""
        shared = self._shared
        if shared is not None and shared.fits(max(spec.reduce_bytes, spec.gather_bytes)):
            return shared
        return self.network

    def close(self) -> None:
        """Stop what the comms own (the watch's thread, shared mappings). Idempotent."""
        comms = (self._shared, self.network, self._world, self.secondary, self.tensor)
        for comm in {id(c): c for c in comms if c}.values():
            comm.close()
        if self.replicas is not None:
            self.replicas.comm.close()


def watch_applies(reshards: bool, host_shared: bool, group: Group) -> bool:
    """Stage 3 gathering through the network on CPU ranks (see [Note: the choices]); never for simulated ranks
    (the watch talks through the process group's store)."""
    real = group.backend != "simulated"
    return reshards and not host_shared and group.size > 1 and group.device.type == "cpu" and real


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def _everyone(comm: Comm, flag: bool) -> bool:
    """Collective: whether ``flag`` holds on every rank."""
    return all(comm.all_gather_object(flag, "shared-memory room"))
