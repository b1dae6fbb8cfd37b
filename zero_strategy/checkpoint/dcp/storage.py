"""Where a DCP checkpoint is written: one streamed data file per rank, published by one atomic step.

[Note: DCP writes that hold one box and survive a crash]
torch's ``FileSystemWriter`` (torch 2.13) keeps a reference to the last box of every tensor it wrote into a file
until the file is closed (it collects them for its safetensors variant even when writing ``torch.save`` records),
so a rank writing its state into one file holds a box of every tensor: memory that grows with the model.
:class:`StreamingFileWriter` keeps torch's writer for everything else (directory set-up, the ``.metadata`` file,
its format) and replaces only ``write_data``: items are resolved one at a time, each serialized as torch does
(``torch.save`` records at recorded offsets, read back by torch's own ``FileSystemReader``) and dropped before the
next, so a writer holds one box.

Publishing mirrors our own format (see [Note: checkpoint layout] in checkpoint/base/format.py). A new checkpoint is
written into a hidden sibling ``.NAME.partial-<id>`` and renamed to ``NAME`` after every rank finished. A DCP checkpoint
that already exists at ``NAME`` (``last.ckpt`` overwritten by ``ModelCheckpoint``) is updated in place: the new data
files carry this save's id in their names, so they never touch the old ones; torch writes the new ``.metadata``
into a scratch folder, and one ``os.replace`` switches ``NAME/.metadata`` from the old files to the new ones. Only
then are the old files deleted. A crash at any moment leaves either the old checkpoint or the new one readable at
``NAME``, never a mixture, and a directory without ``.metadata`` is never renamed to ``NAME``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo  # the record FileSystemReader reads offsets from
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, CheckpointError, fsync_directory
from zero_strategy.checkpoint.dcp.paths import (
    DATA_SUFFIX,
    LIGHTNING_META_NAME,
    METADATA_NAME,
    data_file_name,
    is_dcp_directory,
)


@dataclass(frozen=True, slots=True)
class _DataFile:
    """A rank's part of the global plan: the file it streams its items into."""

    name: str


class StreamingFileWriter(FileSystemWriter):
    """torch's ``FileSystemWriter`` that streams items one at a time into ``__<save id>_<rank>.distcp`` and
    publishes ``.metadata`` with one rename (see [Note: DCP writes that hold one box and survive a crash])."""

    def __init__(self, path: Path, save_id: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self._directory = Path(path)
        self._save_id = save_id

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # No "existing checkpoint" warning: writing beside a previous checkpoint is the protocol (module docstring).
        self._directory.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(plan, storage_data=_DataFile(data_file_name(self._save_id, rank)))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = plan.storage_data.name
        results: list[WriteResult] = []
        future: Future[list[WriteResult]] = Future()
        if not plan.items:  # a hybrid-sharding replica, or a rank whose duplicates another rank writes
            future.set_result(results)
            return future
        with open(self._directory / name, "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)  # one item alive at a time
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    stream.write(data.getbuffer())
                else:
                    assert isinstance(data, torch.Tensor)
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()  # torch.save writes a view's whole storage: keep the box's bytes only
                    torch.save(tensor, stream)
                    del tensor
                del data
                length = stream.tell() - offset
                stored_at = _StorageInfo(name, offset, length)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=stored_at))
            stream.flush()
            os.fsync(stream.fileno())
        future.set_result(results)
        return future

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self._directory), save_id=self.save_id)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """torch's own ``finish`` writes ``.metadata`` into a scratch folder; one ``os.replace`` publishes it."""
        scratch = self._directory / f".metadata-{self._save_id}"
        scratch.mkdir(exist_ok=True)
        self.path = scratch
        try:
            super().finish(metadata, results)
        finally:
            self.path = self._directory
        os.replace(scratch / METADATA_NAME, self._directory / METADATA_NAME)
        fsync_directory(self._directory)
        shutil.rmtree(scratch, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ staging
@dataclass(frozen=True, slots=True)
class DcpStaging:
    """Where one save writes, and how it is published (see the module docstring)."""

    save_id: str
    target: Path
    directory: Path  # the target itself (in-place update) or a hidden sibling renamed to it
    fresh: bool


def plan_dcp_staging(target: Path) -> DcpStaging:
    """Choose where a save to ``target`` writes; raise :class:`CheckpointError` for a target it must not touch."""
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} is a file, not a DCP checkpoint directory; remove it or save elsewhere.")
    if (target / MANIFEST_NAME).is_file():
        raise CheckpointError(
            f"{target} holds a zero_strategy sharded checkpoint ({MANIFEST_NAME}); a DCP checkpoint is not written "
            "over it. Remove it, or save to another path (convert it with `zero-to-dcp` instead)."
        )
    save_id = uuid.uuid4().hex[:12]
    if is_dcp_directory(target):
        return DcpStaging(save_id, target, target, fresh=False)
    if target.is_dir() and any(target.iterdir()):
        raise CheckpointError(
            f"{target} is a directory that is not a DCP checkpoint (no {METADATA_NAME}) and not empty; remove it "
            "or save elsewhere."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    directory = target.parent / f".{target.name}.partial-{save_id}"
    directory.mkdir()
    return DcpStaging(save_id, target, directory, fresh=True)


def publish_dcp(staging: DcpStaging) -> None:
    """After every rank wrote its file and ``.metadata`` is in place: make it the checkpoint at ``target``."""
    if staging.fresh:
        if staging.target.is_dir():  # an empty directory stood there (checked empty by plan_dcp_staging)
            staging.target.rmdir()
        os.rename(staging.directory, staging.target)
        fsync_directory(staging.target.parent)
    _remove_other_saves(staging.target, keep=staging.save_id)
    os.utime(staging.target)  # Lightning's ckpt_path="last" picks the newest directory by modification time


def discard_dcp(staging: DcpStaging) -> None:
    """A save that failed: remove what it wrote; the previous checkpoint (if any) stays as it was."""
    if staging.fresh:
        shutil.rmtree(staging.directory, ignore_errors=True)
        return
    for path in staging.directory.iterdir():
        if staging.save_id in path.name:
            _remove(path)


def _remove_other_saves(directory: Path, keep: str) -> None:
    """Data files of earlier saves (ours or another writer's), scratch folders of dead saves, and a Lightning
    ``meta.pt`` that described the checkpoint this save replaced."""
    own = data_file_name(keep, 0).rsplit("_", 1)[0] + "_"
    for path in directory.iterdir():
        stale_data = path.name.endswith(DATA_SUFFIX) and not path.name.startswith(own)
        scratch = path.name.startswith(f"{METADATA_NAME}-") or path.name == f"{METADATA_NAME}.tmp"
        if stale_data or scratch or path.name == LIGHTNING_META_NAME:
            _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
