"""A DCP save planner for tensors that exist only as boxes read on demand.

``ChunkedTensor`` stands in a nested state dict wherever a tensor is written as this writer's boxes of it (a
rank's slices of a parameter or of its optimizer state, see boxes.py); everything else in the state dict (buffers,
0-d ``step`` counters, param-group hyper-parameters, bytes) goes through torch's own planning unchanged.
:class:`ChunkedSavePlanner` is torch's ``DefaultSavePlanner`` — the same flattening of nested keys
(``optim.state.<fqn>.exp_avg``), the same global plan, metadata and validation that the boxes of every rank tile
each tensor — except that a ``ChunkedTensor`` becomes one ``SHARD`` write item per box, and a box's values are
produced only when the storage writer asks for them, one box at a time.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True, slots=True)
class LazyChunk:
    """One box of a tensor, with a function that produces its values (a tensor of shape ``sizes``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    read: Callable[[], Tensor]


@dataclass(slots=True)
class ChunkedTensor:
    """A tensor of ``shape`` and ``dtype`` of which this writer holds ``chunks`` (other writers hold the rest)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[LazyChunk] = field(default_factory=list)


def _write_item(fqn: str, tensor: ChunkedTensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=tensor.dtype),
            size=torch.Size(tensor.shape),
        ),
    )


class ChunkedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` plus :class:`ChunkedTensor` values (see the module docstring). Items present on
    several ranks (buffers, hyper-parameters) are written by the lowest of them, as rank 0 writes them in our own
    format."""

    def __init__(self) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[ChunkedTensor, LazyChunk]] = {}

    def create_local_plan(self) -> SavePlan:
        # self.state_dict is flat here (set_up_planner flattened it; a ChunkedTensor is a leaf like any object)
        plain = {fqn: value for fqn, value in self.state_dict.items() if not isinstance(value, ChunkedTensor)}
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        self._chunks.clear()
        for fqn, value in self.state_dict.items():
            if not isinstance(value, ChunkedTensor):
                continue
            chunks = value.chunks
            if math.prod(value.shape) == 0 and self.is_coordinator:
                # an empty tensor has no boxes to cut, yet DCP needs one chunk to know it exists
                empty = partial(torch.empty, value.shape, dtype=value.dtype)
                chunks = [LazyChunk((0,) * len(value.shape), value.shape, empty)]
            for chunk in chunks:
                items.append(_write_item(fqn, value, chunk.offsets, chunk.sizes))
                self._chunks[(fqn, chunk.offsets)] = (value, chunk)
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        offsets = tuple(write_item.index.offset) if write_item.index.offset is not None else ()
        found = self._chunks.get((write_item.index.fqn, offsets))
        if found is None:
            return super().resolve_data(write_item)
        tensor, chunk = found
        values = chunk.read()
        if tuple(values.shape) != chunk.sizes or values.dtype != tensor.dtype:
            raise AssertionError(
                f"{write_item.index.fqn}: the box at {list(chunk.offsets)} produced {values.dtype} "
                f"{list(values.shape)}, expected {tensor.dtype} {list(chunk.sizes)}"
            )
        return values
