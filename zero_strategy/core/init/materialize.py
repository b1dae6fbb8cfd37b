"""Initial values that are not in the module's tensors yet: a meta-built module's construction replayed, and
pretrained weights read by element range. Each rank writes only what it keeps (its slice of every FlatParam,
and at stages 1/2 the full parameters every rank holds anyway), so no rank ever holds the whole model.

[Note: sharded construction]
A module built on the meta device (Lightning's ``configure_model`` / ``init_module(empty_init=True)``, or
``core.init.record_construction``) has shapes but no values. The engine plans units from the shapes, gives
every FlatParam its real (empty) buffers, then replays the recorded construction (core/init/): each
parameter's value, bit-for-bit what an eager build with the same seed produces, is handed over as soon as it is
final; the FlatParam copies this rank's part into its shard and the replay frees it. Every rank replays from
rank 0's recorded generator states (where the build started, and every state it set: a seed in configure_model,
a state read before it), so the values are those DDP would broadcast from rank 0. Buffers and the tensors the
module holds besides them (metric states, tensor attributes) are kept whole on every rank. Peak memory: the
shards plus the few tensors the replay holds at once (the largest single tensor, measured), never the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.init import FinalTensor, ModuleReplay, Recording, ReplayStats
from zero_strategy.core.plan.tensor_parallel import is_distributed, local_block


class WeightsReader(Protocol):
    """Element ranges of named tensors (``checkpoint.pretrained.PretrainedSource`` is one)."""

    def read(
        self, name: str, start: int = 0, count: int | None = None, dtype: torch.dtype | None = torch.float32
    ) -> Tensor: ...


@dataclass(frozen=True, slots=True)
class Pretrained:
    """Weights to load: ``sources`` maps a name of the engine's module (state_dict key) to the reader that holds
    it and the name it has there (several files may fill different submodules)."""

    sources: Mapping[str, tuple[WeightsReader, str]]


@dataclass(frozen=True, slots=True)
class InitialValues:
    """Where initial values come from when the module's own tensors do not hold them (yet)."""

    recording: Recording | None = None  # the module (or parts of it) was built on the meta device
    pretrained: Pretrained | None = None  # then overwritten by these weights
    device: torch.device | None = None  # where meta tensors get storage; default: the recording's device


class UnmaterializedError(RuntimeError):
    """A module still has meta tensors and nothing says what their values are."""


def meta_names(module: nn.Module) -> list[str]:
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers())
    return [name for name, tensor in tensors if tensor.is_meta]


def check_materializable(module: nn.Module, values: InitialValues | None) -> torch.device | None:
    """The device meta tensors will be materialized on, or None when there are none; raises when some are
    meta but no recording says how they were built."""
    names = meta_names(module)
    if not names:
        return None
    if values is not None and values.recording is None and values.pretrained is not None:
        # nothing was built here: every meta tensor is read (a released engine's slices, see core/engine/release.py)
        missing = [name for name in names if name not in values.pretrained.sources]
        if not missing and values.device is not None:
            return values.device
        names = missing or names
    if values is None or values.recording is None:
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        raise UnmaterializedError(
            f"the module has tensors on the meta device ({shown}) and no recording of how they were built. Build "
            "it in LightningModule.configure_model() or under Trainer.init_module(empty_init=True) with a ZeRO "
            "strategy, or under zero_strategy.core.init.record_construction() and pass "
            "initial_values=InitialValues(recording=...) to ZeroEngine."
        )
    return values.device or values.recording.device


def prepare_replay(module: nn.Module, recording: Recording) -> ModuleReplay:
    """Prepare the replay while the module's tensors are still meta (the FlatParams then give them storage)."""
    return ModuleReplay(recording, module)


def replay_construction(
    module: nn.Module, flats: Iterable[FlatParam], replay: ModuleReplay, everyone: Comm
) -> ReplayStats:
    """Replay the recorded construction of ``module``'s meta tensors into the FlatParams and buffers (and the
    tensors the module holds besides them). Collective (rank 0's generator states are adopted first)."""
    recording = replay.recording
    # every rank of the run (all replicas) replays from global rank 0's generator states
    recording.generators.adopt(everyone.broadcast_object(recording.generators.states(), 0, "generator states"))
    owner: dict[str, tuple[FlatParam, int]] = {}
    for flat in flats:
        for index, name in enumerate(flat.names):
            owner[name] = (flat, index)

    def on_final(final: FinalTensor, value: Tensor) -> None:
        target = next((owner[name] for name in final.names if name in owner), None)
        if target is not None:
            flat, index = target
            # a tensor-parallel parameter gets the whole value: this rank keeps its TP block (see [Note:
            # tensor-parallel parameters built on the meta device] in core/init/distributed_origins.py)
            flat.write_initial_value(index, local_block(value, flat.params[index]))
            return
        for name in final.names:  # a buffer: every rank keeps it whole (tied names and views stay one storage)
            _set_buffer(module, name, value)

    stats = replay.replay(on_final)
    left = meta_names(module)
    if left:
        raise UnmaterializedError(
            f"after replaying its construction the module still has meta tensors ({', '.join(left[:5])}): they "
            "were made outside the recorded construction; build every parameter and buffer inside "
            "configure_model() / init_module(empty_init=True)."
        )
    return stats


def load_pretrained(module: nn.Module, flats: Iterable[FlatParam], pretrained: Pretrained, rank: int) -> None:
    """Read this rank's element ranges of every planned parameter straight into the shards (fp32 masters), and
    whole buffers into the module. The caller publishes the shards afterwards (stages 1/2 re-gather ``full``)."""
    with torch.no_grad():
        for flat in flats:
            positions = {name: index for index, name in enumerate(flat.names)}
            for overlap in flat.layout.overlaps(rank):
                if overlap.name not in pretrained.sources:  # strict=False: left as initialized
                    continue
                reader, source = pretrained.sources[overlap.name]
                param = flat.params[positions[overlap.name]]
                # A file holds the global tensor: this rank's TP block of it, then its range. A released engine's
                # slices (ReleasedShards, whose readers say `local_blocks`) are of the local blocks already.
                if is_distributed(param) and not getattr(reader, "local_blocks", False):
                    whole = reader.read(source, 0, param.numel(), dtype=flat.shard.dtype).view(param.shape)
                    block = local_block(whole, param).reshape(-1)
                    values = block[overlap.param_start : overlap.param_start + overlap.numel]
                else:
                    values = reader.read(source, overlap.param_start, overlap.numel, dtype=flat.shard.dtype)
                flat.write_shard_range(positions[overlap.name], overlap.param_start, values)
        for name, buffer in module.named_buffers():
            if name in pretrained.sources:
                reader, source = pretrained.sources[name]
                buffer.copy_(reader.read(source, dtype=buffer.dtype).view_as(buffer))


def _set_buffer(module: nn.Module, name: str, value: Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._buffers[attr] = value
