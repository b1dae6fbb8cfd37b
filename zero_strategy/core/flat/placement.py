"""Where sharded state lives: the compute device, host memory, or memory-mapped files ("nvme").

[Note: nvme offload]
Each file-backed tensor is a shared memory mapping of its own file, created by torch on top of Python's ``mmap``.
Writes land in the OS page cache and reach the file without copies; after each use (a chunk of the optimizer step,
a gather) the mapping's pages are released with ``madvise(MADV_DONTNEED)`` so they stop counting as this
process's resident memory. The optimizer therefore steps in chunks (see core/engine/chunked_step.py): resident memory
of a step is a few chunks, not the whole optimizer state.

[Note: populating a chunk before its step]
Released pages come back one page fault at a time when the optimizer touches them; with the fused kernel (one pass
over memory) those faults were ~90 % of a step (100 M parameters: 0.6 s of faults, 0.06 s of arithmetic).
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) maps a chunk's pages in one call, measured ~3 x faster than faulting
them; where the kernel lacks it the step simply faults as before.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from zero_strategy.config import OffloadDevice, ZeroConfig
from zero_strategy.core.plan.units import UnitPlan

# Python 3.11's mmap lacks the name; 23 is Linux's value (and means something else elsewhere, so only there)
MADV_POPULATE_WRITE: int | None = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


class OffloadError(RuntimeError):
    """Offload cannot work as configured (unwritable path, too little space): raised before training."""


class NvmeStore:
    """File-backed 1-D tensors in a private folder under ``root``; :meth:`close` deletes the folder."""

    def __init__(self, root: str | os.PathLike, rank: int) -> None:
        base = Path(root)
        try:
            base.mkdir(parents=True, exist_ok=True)
            self.folder = base / f"zero-offload-rank{rank}-{uuid.uuid4().hex[:8]}"
            self.folder.mkdir()
            probe = self.folder / ".probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as error:
            raise OffloadError(f"nvme_path={str(base)!r} is not a writable directory: {error}") from error
        self._maps: dict[str, mmap.mmap] = {}
        self._tensors: dict[int, str] = {}  # id(tensor) -> file name, for page release
        self._regions: list[tuple[int, int, mmap.mmap]] = []  # (address, bytes, mapping), to find a view's file
        self._can_populate = MADV_POPULATE_WRITE is not None  # until the kernel says it does not know it

    @staticmethod
    def check_space(root: str | os.PathLike, needed_bytes: int) -> None:
        free = shutil.disk_usage(Path(root) if Path(root).exists() else Path(root).parent).free
        if free < needed_bytes * 1.05:
            raise OffloadError(
                f"nvme_path={str(root)!r} has {free / 2**30:.2f} GiB free but this rank needs about "
                f"{needed_bytes / 2**30:.2f} GiB for offloaded state; free space or choose another path."
            )

    def tensor(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        """A zero-filled tensor backed by the file ``name`` (created here)."""
        nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
        path = self.folder / name
        with open(path, "wb") as handle:
            handle.truncate(nbytes)  # sparse file: zeros without writing them
        with open(path, "r+b") as handle:
            mapping = mmap.mmap(handle.fileno(), nbytes, access=mmap.ACCESS_WRITE)
        self._maps[name] = mapping
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        self._regions.append((raw.data_ptr(), nbytes, mapping))
        tensor = raw.view(dtype)[:numel]
        self._tensors[id(tensor)] = name
        return tensor

    def populate(self, tensors: list[Tensor]) -> None:
        """Map the pages under these (contiguous) views of file-backed tensors in one call each, before a pass over
        them (see [Note: populating a chunk before its step]); tensors not in a file are skipped."""
        for tensor in tensors:
            if not self._can_populate or MADV_POPULATE_WRITE is None:
                return
            if tensor.numel() == 0:
                continue
            start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            for address, size, mapping in self._regions:
                if address <= start and start + nbytes <= address + size:
                    offset = start - address
                    aligned = offset - offset % mmap.PAGESIZE
                    try:
                        mapping.madvise(MADV_POPULATE_WRITE, aligned, offset + nbytes - aligned)
                    except OSError as error:  # the pages are then faulted in by the step, as without this call
                        if error.errno == errno.EINVAL:  # a kernel before 5.14: do not ask again
                            self._can_populate = False
                    break

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s elements lie in one of this store's files."""
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        return any(address <= start and start + nbytes <= address + size for address, size, _ in self._regions)

    def release_pages(self) -> None:
        """Drop every mapping's pages from this process's resident set (the data stays in the files)."""
        for mapping in self._maps.values():
            mapping.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._maps.clear()  # mappings close when the last tensor viewing them is gone
        self._tensors.clear()
        self._regions.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(slots=True)
class Placement:
    """Allocates the per-rank sharded buffers where the offload settings say."""

    optimizer: OffloadDevice
    param: OffloadDevice
    compute_device: torch.device
    pin_memory: bool
    store: NvmeStore | None

    @property
    def host_shards(self) -> bool:
        return self.optimizer is not OffloadDevice.none

    @property
    def keeps_device_gather_source(self) -> bool:
        """Stage 3 with offloaded masters but parameters on the device: keep a compute-dtype copy there."""
        return self.host_shards and self.param is OffloadDevice.none

    def after_host_read(self) -> None:
        """A gather read the file-backed slices: let their pages go (see [Note: nvme offload])."""
        if self.store is not None:
            self.store.release_pages()

    def shard_buffer(self, name: str, numel: int, dtype: torch.dtype) -> Tensor:
        if self.optimizer is OffloadDevice.nvme:
            assert self.store is not None
            return self.store.tensor(name, numel, dtype)
        if self.optimizer is OffloadDevice.cpu:
            pin = self.pin_memory and self.compute_device.type == "cuda"
            return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)
        return torch.zeros(numel, dtype=dtype, device=self.compute_device)


def make_placement(config: ZeroConfig, device: torch.device, plans: list[UnitPlan], rank: int) -> Placement | None:
    """The offload placement for this run (``device``: where the module computes), or None; checks the nvme
    path's space before anything is written."""
    if config.offload_optimizer is OffloadDevice.none and config.offload_param is OffloadDevice.none:
        return None
    store = None
    if OffloadDevice.nvme in (config.offload_optimizer, config.offload_param):
        assert config.nvme_path is not None
        numel = sum(p.numel() for plan in plans for _, p in plan.named_params)
        # this rank's masters (1/N of the model), their gradients and up to three state tensors of the same size
        # (Adam has two, three with amsgrad)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        NvmeStore.check_space(config.nvme_path, 5 * 4 * numel // world)
        store = NvmeStore(config.nvme_path, rank)
    return Placement(config.offload_optimizer, config.offload_param, device, config.pin_memory, store)
