"""DCP checkpoints of tensor-parallel runs: where a rank's boxes sit in the whole tensors, which rank writes what,
and the world a save agrees over.

[Note: DCP boxes of a tensor-parallel block]
With ``tensor_parallel_size=K`` a rank's engine flattens the *local* block of each DTensor parameter (see [Note:
ZeRO over the data-parallel dimension of a 2-D mesh] in core/plan/tensor_parallel.py), so its ZeRO slice covers a
flat range of the block, not of the whole tensor. The block itself is a box of the whole tensor (``Shard(d)``:
rows ``o .. o+l`` of dimension ``d``, every index of the other dimensions), so the range is cut into boxes *of the
block* (boxes.py: at most ``2·(ndim−1)+1``, each a contiguous run of the slice) and each box is shifted by the
block's offset. The result is a box of the whole tensor whose values are still one contiguous run of the slice:
the smallest decomposition, whatever ``d`` is (cutting the whole tensor's flat ranges instead would need one box
per outer index when ``d > 0``). DCP's metadata then records every tensor at its global shape, tiled by the boxes
of all ranks, as FSDP2 / ModelParallelStrategy record theirs, so any reader reshards by intersection: our reader at
any data-parallel or tensor-parallel size (blocks.py), ``dcp.load`` into a DTensor state dict.

A block every TP rank holds whole (``Replicate()``, or a parameter the plan left plain) is written by TP
coordinate 0 only: the boxes of all ranks must tile each tensor exactly once. Per-element optimizer state follows
its parameter; everything written once (buffers, scalars, groups, trainer state) comes from world rank 0; each
rank's RNG state is keyed by its world rank (the mesh numbers rank ``d·K + t`` as DP coordinate ``d``, TP
coordinate ``t``: adapter_plumbing/process_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed import ProcessGroup

from zero_strategy.checkpoint.base.writable import WritableSource
from zero_strategy.checkpoint.sharded.tensor_parallel_blocks import run_blocks
from zero_strategy.core.comm.comm import Comm


@dataclass(frozen=True, slots=True)
class Placed:
    """Where this rank's block of one parameter sits in the whole tensor DCP records."""

    shape: tuple[int, ...]  # the whole tensor
    block: tuple[int, ...]  # this rank's block (what its flat layout covers)
    offsets: tuple[int, ...]  # the block's first index along each dimension
    written: bool  # whether this rank writes boxes of it (a replicated block: TP coordinate 0 only)


def placements(engine: WritableSource, tp_rank: int) -> dict[str, Placed]:
    """Every parameter of ``engine`` (canonical names) placed in its whole tensor; without tensor parallelism every
    block is the whole tensor, written by its owner."""
    spans = {span.name: tuple(span.shape) for _, flat, _ in engine.named_flat_params() for span in flat.layout.spans}
    tensor = engine.comms.tensor
    if tensor is None or tensor.size == 1:
        return {name: Placed(shape, shape, (0,) * len(shape), True) for name, shape in spans.items()}
    blocks = run_blocks(engine.module)
    placed: dict[str, Placed] = {}
    for name, block_shape in spans.items():
        block, local = blocks[name]
        if tuple(local) != block_shape:  # never write boxes at a place the reader would not look
            raise AssertionError(f"{name}: the flat layout holds {list(block_shape)}, the module's block {local}")
        if block.dim is None:
            whole = tuple(engine.module.get_parameter(name).shape)
            placed[name] = Placed(whole, block_shape, (0,) * len(whole), tp_rank == 0)
            continue
        shape = list(block_shape)
        shape[block.dim] = block.rows
        offsets = [0] * len(shape)
        offsets[block.dim] = block.start
        placed[name] = Placed(tuple(shape), block_shape, tuple(offsets), True)
    return placed


class SaveWorld:
    """The ranks one DCP save agrees over: the engine's ``everyone`` without tensor parallelism; with it, every
    rank of the world, reached through the data-parallel group and then the tensor-parallel group (the writers
    hold no Comm over the whole world; DCP's own collectives run over the default process group, which is it)."""

    def __init__(self, engine: WritableSource) -> None:
        self.dp = engine.comms.everyone
        tensor = engine.comms.tensor
        self.tp: Comm | None = tensor if tensor is not None and tensor.size > 1 else None
        self.tp_rank = 0 if self.tp is None else self.tp.rank
        self.tp_size = 1 if self.tp is None else self.tp.size
        self.rank = self.dp.rank * self.tp_size + self.tp_rank  # the mesh's numbering (see the module docstring)
        self.size = self.dp.size * self.tp_size

    @property
    def process_group(self) -> ProcessGroup | None:
        """What ``dcp.save`` runs its collectives over (None: the default group, the whole world)."""
        return self.dp.group.handle if self.tp is None else None

    def broadcast_object(self, value: Any, label: str) -> Any:
        """World rank 0's ``value`` on every rank: over the DP group of TP coordinate 0, then over each TP group."""
        if self.tp_rank == 0:
            value = self.dp.broadcast_object(value, 0, label)
        return value if self.tp is None else self.tp.broadcast_object(value, 0, label)

    def all_gather_object(self, value: Any, label: str) -> list[Any]:
        """Every rank's ``value``, in world-rank order."""
        over_dp = self.dp.all_gather_object(value, label)
        if self.tp is None:
            return list(over_dp)
        over_tp = self.tp.all_gather_object(over_dp, label)  # [t][d]: DP rank d of TP coordinate t
        return [over_tp[t][d] for d in range(self.dp.size) for t in range(self.tp_size)]
