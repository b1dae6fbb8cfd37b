"""Writing a running engine's state as a ``torch.distributed.checkpoint`` directory (``checkpoint_format="dcp"``):
every rank writes the boxes of its own slices through DCP's collective save; nothing is gathered.

Sequence (as in checkpoint/sharded/save.py): rank 0 picks where this save writes (a hidden sibling, or the existing DCP
checkpoint's directory, see checkpoint/dcp/storage.py) and tells every rank; the ranks agree on which optimizer states
exist (every rank must cut the same tensors into boxes, or the boxes would not tile them: a piece never stepped has no
state on its rank); DCP's collective save writes every rank's file and, once all succeeded, ``.metadata``; rank 0
publishes. A failure anywhere is raised on every rank, after the save's leftovers were removed; the previous checkpoint
at the path is untouched. With hybrid sharding the replicas' ranks take part in the collectives but write no boxes
(they hold the first shard group's slices). The key layout is [Note: DCP key layout] in checkpoint/dcp/content.py.
With tensor parallelism the save spans the whole world and every box is placed in its whole tensor: [Note: DCP boxes
of a tensor-parallel block] in checkpoint/dcp/tensor_parallel.py.
"""

from __future__ import annotations

import os
import warnings
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.base.rng import capture_rng
from zero_strategy.checkpoint.base.writable import WritableSource
from zero_strategy.checkpoint.dcp.content import (
    INFO,
    MODEL,
    OURS,
    RNG,
    TRAINER_STATE,
    add_range,
    info_json,
    optimizer_content,
    param_group_entries,
    rng_record,
    to_bytes,
)
from zero_strategy.checkpoint.dcp.planner import ChunkedSavePlanner, ChunkedTensor
from zero_strategy.checkpoint.dcp.storage import (
    DcpStaging,
    StreamingFileWriter,
    discard_dcp,
    plan_dcp_staging,
    publish_dcp,
)
from zero_strategy.checkpoint.dcp.tensor_parallel import Placed, SaveWorld, placements
from zero_strategy.checkpoint.sharded.save import SaveInfo
from zero_strategy.core.engine.optimizer import qualified_name
from zero_strategy.core.plan.layout import SliceOverlap

# what one rank knows of each (optimizer, parameter)'s state: {per-element name: dtype}, {scalar: (value, dtype)}
StateSummary = dict[tuple[int, str], tuple[dict[str, str], dict[str, tuple[Any, str | None]]]]


def save_dcp(engine: WritableSource, path: str | os.PathLike, trainer_state: dict[str, Any], info: SaveInfo) -> None:
    """Collective: every rank of the engine's run calls this with the same ``path`` (as :func:`save_sharded`); with
    tensor parallelism every rank of the world (see [Note: DCP boxes of a tensor-parallel block])."""
    place, world = engine.place, SaveWorld(engine)
    target = Path(path)
    writes = place.replica_index == 0  # replicas hold the first shard group's slices
    leader = world.rank == 0 and writes
    planned: DcpStaging | str | None = None
    if leader:
        try:
            planned = plan_dcp_staging(target)
        except (OSError, CheckpointError) as error:
            planned = f"cannot write a DCP checkpoint at {target}: {error}"
    planned = world.broadcast_object(planned, "DCP staging")
    if not isinstance(planned, DcpStaging):
        raise CheckpointError(str(planned))
    staging = planned
    with_optimizer = "optimizer_states" in trainer_state
    failure: str | None = None
    placed: dict[str, Placed] = {}
    try:
        placed = placements(engine, world.tp_rank)  # a placement no reader knows is refused here, by name
        summary = _optimizer_summary(engine) if with_optimizer and writes else {}
        report: tuple[bool, Any] = (True, summary)
    except Exception as error:  # every rank must reach the agreement, or the others wait for nothing
        report = (False, f"rank {world.rank}: {type(error).__name__}: {error}")
    reports = world.all_gather_object(report, "DCP optimizer-state agreement")
    failures = [message for ok, message in reports if not ok]
    if failures:
        failure = "; ".join(failures)
    else:
        agreed = _agree([summary for _, summary in reports])
        content = engine_state_dict(
            engine, trainer_state, info, agreed if with_optimizer else None, (leader, writes), (world, placed)
        )
        failure = _write(staging, content, world)  # raised on every rank or on none (DCP agrees on it)
    if leader:
        if failure is None:
            try:
                publish_dcp(staging)
            except OSError as error:
                failure = f"rank 0 publishing: {error}"
        if failure is not None:
            discard_dcp(staging)
    failure = world.broadcast_object(failure, "DCP outcome")  # nobody returns before it is published
    if failure is not None:
        raise CheckpointError(f"saving {target} failed; the previous checkpoint is untouched: {failure}")


def _write(staging: DcpStaging, content: dict[str, Any], world: SaveWorld) -> str | None:
    """DCP's collective save over ``everyone``'s process group; one writer alone (a module no engine holds, see
    checkpoint/sharded/module_snapshot.py) saves without any group, whatever the world."""
    try:
        with warnings.catch_warnings():  # without a process group DCP warns that it saves from one process: it does
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(
                content,
                storage_writer=StreamingFileWriter(staging.directory, staging.save_id),
                planner=ChunkedSavePlanner(),
                process_group=world.process_group,
                no_dist=world.size == 1,
            )
    except CheckpointException as error:  # a BaseException: DCP's report of the ranks that failed, on every rank
        return f"{type(error).__name__}: {_failures(error)}"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _failures(error: CheckpointException) -> str:
    """Each failed rank's exception, one line each (DCP's own message is a traceback per rank)."""
    failed = sorted((rank, exc) for rank, (exc, _) in error.failures.items())
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in failed)


def engine_state_dict(
    engine: WritableSource,
    trainer_state: dict[str, Any],
    info: SaveInfo,
    optimizer_state: StateSummary | None,
    roles: tuple[bool, bool],
    where: tuple[SaveWorld, dict[str, Placed]],
) -> dict[str, Any]:
    """This rank's part of the nested state dict of [Note: DCP key layout]: the boxes of its slices (if it
    writes: ``roles[1]``), and — on the leader (``roles[0]``) only — what is written once (buffers, scalars,
    groups, trainer state); ``where``: the ranks of the save and each parameter's place in its whole tensor."""
    (leader, writes), (world, placed) = roles, where
    rank = engine.place.rank
    weights = _weights(engine, rank if writes else None, placed)
    names = engine.parameter_names()
    model: dict[str, Any] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in names:
            model[key] = weights[names[id(value)]]
        elif leader:
            model[key] = value.detach().cpu() if isinstance(value, Tensor) else value
    content: dict[str, Any] = {MODEL: model}
    if optimizer_state is not None:
        states = _optimizer_tensors(engine, optimizer_state, rank if writes else None, leader, placed)
        shared = any(len(optimizers) > 1 for _, _, optimizers in engine.named_flat_params())
        content.update(optimizer_content(states, _param_groups(engine) if leader else None, shared))
    own: dict[str, Any] = {RNG: {str(world.rank): rng_record(*capture_rng())}} if writes else {}
    if leader:
        optimizers = [{"class": qualified_name(o), "param_groups": len(o.param_groups)} for o in engine.optimizers]
        own[TRAINER_STATE] = to_bytes(trainer_state)
        ranks = engine.place.world_size * world.tp_size  # the shard group's ranks, times the TP size
        own[INFO] = info_json(
            ranks, int(engine.stage), info.precision, info.versions, optimizers, dict(info.extra), world.tp_size
        )
    content[OURS] = own
    return content


def _weights(engine: WritableSource, rank: int | None, placed: dict[str, Placed]) -> dict[str, ChunkedTensor]:
    """Every parameter (canonical name) as a :class:`ChunkedTensor` of its whole shape holding the boxes of
    ``rank``'s slice of this rank's block of it (none when ``rank`` is None: a replica's rank writes nothing; none
    of a replicated block off TP coordinate 0)."""
    weights: dict[str, ChunkedTensor] = {}
    for _, flat, _ in engine.named_flat_params():
        for span in flat.layout.spans:
            weights[span.name] = ChunkedTensor(placed[span.name].shape, flat.shard.dtype)
        if rank is None:
            continue
        for piece in flat.layout.overlaps(rank):
            if not placed[piece.name].written:
                continue
            base = piece.shard_start - piece.param_start  # shard index of the parameter's element 0

            def read(first: int, count: int, shard: Tensor = flat.shard, base: int = base) -> Tensor:
                return shard[base + first : base + first + count]

            add_range(weights[piece.name], piece.param_start, piece.numel, read, placed[piece.name])
    return weights


class _OptimizedPart(NamedTuple):
    """The part of one parameter that one master piece holds on this rank, and one optimizer's state of that
    piece (a piece several optimizers step makes one part per optimizer)."""

    optimizer: int
    name: str
    overlap: SliceOverlap
    within: int  # where the part starts inside the piece
    piece: nn.Parameter
    state: dict[str, Any]


def _optimized_parts(engine: WritableSource, rank: int) -> list[_OptimizedPart]:
    parts = []
    for _, flat, optimizers in engine.named_flat_params():
        overlaps = flat.layout.overlaps(rank)
        for opt_index in optimizers:
            state = engine.optimizers[opt_index].state
            for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
                for overlap in overlaps:
                    if offset <= overlap.shard_start < offset + piece.numel():
                        within = overlap.shard_start - offset
                        parts.append(
                            _OptimizedPart(opt_index, overlap.name, overlap, within, piece, state.get(piece, {}))
                        )
    return parts


def _optimizer_summary(engine: WritableSource) -> StateSummary:
    summary: StateSummary = {}
    for part in _optimized_parts(engine, engine.place.rank):
        per_element, scalars = summary.setdefault((part.optimizer, part.name), ({}, {}))
        for key, value in part.state.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape == part.piece.shape:
                per_element[key] = str(value.dtype).removeprefix("torch.")
            elif isinstance(value, Tensor):
                scalars.setdefault(key, (value.item(), str(value.dtype).removeprefix("torch.")))
            else:
                scalars.setdefault(key, (value, None))
    return summary


def _agree(summaries: list[StateSummary]) -> StateSummary:
    """Every rank's summary merged: per-element names are the union; a scalar comes from the lowest rank."""
    agreed: StateSummary = {}
    for summary in summaries:
        for name, (per_element, scalars) in summary.items():
            merged_elements, merged_scalars = agreed.setdefault(name, ({}, {}))
            for key, dtype in per_element.items():
                merged_elements.setdefault(key, dtype)
            for key, record in scalars.items():
                merged_scalars.setdefault(key, record)
    return {name: entry for name, entry in agreed.items() if entry[0] or entry[1]}


def _optimizer_tensors(
    engine: WritableSource, agreed: StateSummary, rank: int | None, leader: bool, placed: dict[str, Placed]
) -> list[dict[str, dict[str, Any]]]:
    """Per optimizer, its state by parameter fqn: per-element state as this rank's boxes, scalars (leader only)."""
    states: list[dict[str, dict[str, Any]]] = [{} for _ in engine.optimizers]
    for (opt_index, name), (per_element, scalars) in agreed.items():
        state = states[opt_index].setdefault(name, {})
        for key, dtype in per_element.items():
            state[key] = ChunkedTensor(placed[name].shape, getattr(torch, dtype))
        if leader:
            for key, (value, scalar_dtype) in scalars.items():
                is_tensor = scalar_dtype is not None
                state[key] = torch.tensor(value, dtype=getattr(torch, str(scalar_dtype))) if is_tensor else value
    if rank is None:
        return states
    for part in _optimized_parts(engine, rank):
        if not placed[part.name].written:
            continue
        for key in agreed.get((part.optimizer, part.name), ({}, {}))[0]:
            tensor = states[part.optimizer][part.name][key]
            values = part.state.get(key)
            at = part.within - part.overlap.param_start  # piece index of the parameter's element 0
            read = partial(_zeros, tensor.dtype) if values is None else partial(_slice, values.reshape(-1), at)
            add_range(tensor, part.overlap.param_start, part.overlap.numel, read, placed[part.name])
    return states


def _slice(values: Tensor, at: int, first: int, count: int) -> Tensor:
    return values[at + first : at + first + count]


def _zeros(dtype: torch.dtype, first: int, count: int) -> Tensor:
    """A piece never stepped on this rank: zeros, as our own format stores it."""
    return torch.zeros(count, dtype=dtype)


def _param_groups(engine: WritableSource) -> list[list[dict[str, Any]]]:
    """Per optimizer, its param groups with the fqns of their parameters."""
    members: dict[tuple[int, int], list[str]] = {}
    for _, flat, optimizers in engine.named_flat_params():
        for opt_index in optimizers:
            for name, group in zip(flat.names, flat.param_group_in(opt_index), strict=True):
                members.setdefault((opt_index, group), []).append(name)
    hyper = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in engine.optimizers]
    return param_group_entries(hyper, members)
