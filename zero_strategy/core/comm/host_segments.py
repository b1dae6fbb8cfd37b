"""Stage 3 on CPU ranks of one host: each unit's parameters once per host in shared memory, read in place.

[Note: shared-memory gathers]
On one host the ranks' shards can simply be read by their peers. Each stage-3 FlatParam's whole padded flat buffer
(every rank's slice side by side, in the compute dtype) is one file under ``/dev/shm`` that every local rank maps;
rank r reserves and writes only its own slice, and the module's parameters are views of the mapping. Gathering a
unit is then nothing at all: forward and backward read the peers' slices where they lie. The point-to-point
gathers this replaces took 16 ms of a 5.3 M model's forward on 2 ranks, and the copying gathers that came
between (each rank copying every peer's slice into a private buffer each time a unit was needed) cost zero3 about
16 ms per step more than zero2 on the same model. In fp32 the slice *is* the rank's master shard; under
bf16/fp16 the master shard stays private and each step writes its rounded copy into the slice.

Correctness rests on one rule: a rank writes its slice only between the two barriers that bracket an optimizer
step (the engine's step barriers: a post and a spin on the shared counters of [Note: shared-memory reductions]
where the host has them, else the process group's barrier), and after a checkpoint load or construction. Every
read happens in forward/backward or in ``gathered_parameters``, outside that window, on every rank.

When a unit is released after use, the peers' pages of its buffer are dropped from the reading process's resident
set (``MADV_DONTNEED``; they stay in shared memory, where their owner keeps them): each rank's RSS holds its own
slices plus the units in use, as with gathered copies, and the next use maps them back (a minor fault per page,
no copy). The buffer costs the host the model's compute-dtype parameters once, instead of once per rank whenever
every rank has the same unit gathered.

The files are unlinked as soon as every rank has mapped them, so nothing is left in ``/dev/shm`` when a process
ends, however it ends; only a crash during set-up itself can leave them (named ``zero-shards-<run>-...``). The
space is checked before set-up and each rank reserves its slices with ``posix_fallocate``: a too-small
``/dev/shm`` (Docker's default is 64 MiB) makes every rank fall back to point-to-point gathers together (with a
warning; an error if ``collectives="shared_memory"`` was asked for) instead of crashing later with SIGBUS or
leaving peers waiting. Ranks that see different ``/dev/shm`` folders (containers sharing a hostname) are found by
a roll call: each rank's one-page file must be visible to every peer.
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid

import torch
from torch import Tensor

from zero_strategy.core.comm.comm import Comm

SHM_DIR = "/dev/shm"


class HostSharedFull:
    """One stage-3 FlatParam's whole flat buffer, once per host (see [Note: shared-memory gathers]): a full buffer
    (the ``FullBuffer`` of core/flat/full_buffer.py) whose peers' slices are read in place, never gathered."""

    readable_in_place = True  # the peers' slices are readable where they lie: a gather moves nothing
    resizable = False

    def __init__(self, values: Tensor, own_bytes: tuple[int, int], mapping: mmap.mmap) -> None:
        self.tensor = values  # 1-D, compute dtype: every rank's slice side by side
        self.own_bytes = own_bytes  # [start, end) of this rank's slice, in bytes
        self._mapping: mmap.mmap | None = mapping

    @property
    def resident_bytes(self) -> int:
        """What this rank holds of the buffer for its own: its slice (the peers' pages are theirs)."""
        return self.own_bytes[1] - self.own_bytes[0]

    def allocate(self) -> None:
        """Nothing to do: the buffer stays mapped for the whole run (the next read faults the pages back in)."""

    def free(self) -> None:
        """Drop the peers' pages from this process's resident set; see :meth:`release_peer_pages`."""
        self.release_peer_pages()

    def detach(self) -> None:
        """The engine lets go: forget the mapping (it is unmapped when the last view of it is gone)."""
        self.tensor, self._mapping = self.tensor.new_empty(0), None

    def release_peer_pages(self) -> None:
        """Drop the peers' pages from this process's resident set (they stay in shared memory); this rank's own
        slice stays mapped. Only whole pages are dropped: one shared with the neighbour's slice stays."""
        if self._mapping is None:
            return
        page, (start, end), total = mmap.PAGESIZE, self.own_bytes, len(self._mapping)
        before = start - start % page  # pages wholly before our slice
        after = -(-end // page) * page  # the first page wholly after it
        if before > 0:
            self._mapping.madvise(mmap.MADV_DONTNEED, 0, before)
        if after < total:
            self._mapping.madvise(mmap.MADV_DONTNEED, after, total - after)


class HostSegments:
    """This rank's files in ``/dev/shm`` and its peers' mappings of theirs, keyed by allocation order (the same on
    every rank). ``comm``: the group's network Comm, for the few set-up agreements."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.size
        self._run = comm.broadcast_object(uuid.uuid4().hex[:12], 0, "shared-memory run id")
        self._own: list[Tensor] = []
        self._dtypes: list[tuple[int, torch.dtype]] = []
        self._peers: list[list[Tensor]] = []  # per key: every rank's shard, in rank order
        self.connected = False  # False until connect() succeeded everywhere: gathers then use the network
        self.failure: str | None = None  # why this rank's shards are not in shared memory, if they are not
        self._full_buffers = 0  # node-shared buffers allocated (their file names are numbered in that order)
        self._roll_call_key: int | None = None  # a one-page file of ours every peer must see (see the Note)

    @staticmethod
    def same_host(comm: Comm) -> bool:
        """Collective: every rank of the group sees this host (hostname and kernel boot id)."""
        everyone = comm.all_gather_object((socket.gethostname(), _boot_id()), "host check")
        return all(entry == everyone[0] for entry in everyone)

    def _path(self, rank: int, key: int) -> str:
        return os.path.join(SHM_DIR, f"zero-shards-{self._run}-r{rank}-{key}")

    def allocate(self, numel: int, dtype: torch.dtype) -> tuple[Tensor, int]:
        """A zero-filled tensor of ``numel`` elements in a file peers can map, and its key. Without room in
        ``/dev/shm`` it is ordinary memory instead, and :meth:`connect` makes every rank fall back together (a rank
        that raised here would leave its peers waiting in the next collective)."""
        key = len(self._own)
        self._dtypes.append((numel, dtype))
        path = self._path(self.rank, key)
        nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        if self.failure is None:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(descriptor, 0, nbytes)  # ENOSPC now rather than SIGBUS on first touch
            except OSError as error:
                self.failure = f"rank {self.rank} could not reserve {nbytes} bytes in {SHM_DIR} ({error})"
                os.unlink(path)
            finally:
                os.close(descriptor)
        if self.failure is not None:
            self._own.append(torch.zeros(numel, dtype=dtype))
        else:
            self._own.append(torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)[:numel])
        return self._own[key], key

    def allocate_full(self, numel: int, dtype: torch.dtype, own: tuple[int, int]) -> HostSharedFull | None:
        """A zero-filled buffer of ``numel`` elements in one file every local rank maps, of which this rank
        reserves only its own elements ``own = (start, end)`` (their pages are charged to it). None without room:
        :meth:`connect` then makes every rank fall back together."""
        if self._roll_call_key is None:
            self._roll_call_key = self.allocate(1, torch.uint8)[1]
        path = os.path.join(SHM_DIR, f"zero-shards-{self._run}-full-{self._full_buffers}")
        self._full_buffers += 1
        item = torch.empty((), dtype=dtype).element_size()
        nbytes, own_bytes = max(numel, 1) * item, (own[0] * item, own[1] * item)
        if self.failure is None:
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)  # whichever rank comes first creates it
                try:
                    os.ftruncate(descriptor, nbytes)  # the same size from every rank; no pages yet
                    if own_bytes[1] > own_bytes[0]:  # ENOSPC now rather than SIGBUS on first touch
                        os.posix_fallocate(descriptor, own_bytes[0], own_bytes[1] - own_bytes[0])
                    mapping = mmap.mmap(descriptor, nbytes, mmap.MAP_SHARED)
                finally:
                    os.close(descriptor)
                values = torch.frombuffer(mapping, dtype=dtype, count=max(numel, 1))[:numel]
                return HostSharedFull(values, own_bytes, mapping)
            except OSError as error:
                self.failure = f"rank {self.rank} could not reserve {nbytes} bytes in {SHM_DIR} ({error})"
        return None

    def connect(self) -> bool:
        """Collective: map every peer's files, then unlink our own (mappings outlive the names). False, on every
        rank, with the reason in ``failure``, when some rank could not reserve its files or map a peer's (separate
        ``/dev/shm`` namespaces, e.g. containers that share a hostname): gathers then go through the network and
        the shards are only local memory."""
        # Agree on allocation first (also the barrier: every file exists before anyone maps it), then on mapping.
        self.failure = _first(self.comm.all_gather_object(self.failure, "shared-memory set-up"))
        if self.failure is None:
            try:
                for key, (numel, dtype) in enumerate(self._dtypes):
                    self._peers.append([self._own[key] if rank == self.rank else self._map(rank, key, numel, dtype)
                                        for rank in range(self.world_size)])
            except OSError as error:
                self.failure = f"rank {self.rank} could not map a peer's shard file ({error})"
            # the second agreement is also the barrier before unlinking
            self.failure = _first(self.comm.all_gather_object(self.failure, "shared-memory set-up"))
        self.discard_files()
        self.connected = self.failure is None
        if not self.connected:
            self._peers = []
        return self.connected

    def _map(self, rank: int, key: int, numel: int, dtype: torch.dtype) -> Tensor:
        nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        with open(self._path(rank, key), "r+b") as handle:  # FileNotFoundError: not the same /dev/shm
            mapping = mmap.mmap(handle.fileno(), nbytes, mmap.MAP_SHARED)
        return torch.frombuffer(mapping, dtype=dtype, count=max(numel, 1))[:numel]

    def discard_files(self) -> None:
        """Remove this rank's file names and the node-shared buffers' (idempotent; also the clean-up when set-up
        fails half-way)."""
        paths = [self._path(self.rank, key) for key in range(len(self._own))]
        paths += [os.path.join(SHM_DIR, f"zero-shards-{self._run}-full-{key}") for key in range(self._full_buffers)]
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:  # a peer unlinked the shared buffer first
                pass

    def shards(self, key: int) -> list[Tensor]:
        """Every rank's shard for ``key``, in rank order (ours included)."""
        return self._peers[key]

def _first(failures: list[str | None]) -> str | None:
    return next((failure for failure in failures if failure is not None), None)


def free_bytes(path: str = SHM_DIR) -> int:
    """Bytes ``/dev/shm`` (or ``path``) can still take; 0 where it does not exist."""
    if not os.path.isdir(path):
        return 0
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def _boot_id() -> str:
    """Distinguishes two machines (or containers with their own kernel) that happen to share a hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""
