"""Liveness of a recording: which ops run on real storage, which on scratch, which are skipped, when to free."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from zero_strategy.core.init.attribute_tensors import AttributeTensor
from zero_strategy.core.init.ops import DeferredInitError, RecordedOp, TensorRef
from zero_strategy.core.init.record import Recording
from zero_strategy.core.plan.tensor_parallel import is_distributed, local_part


@dataclass(frozen=True, slots=True)
class FinalTensor:
    """One parameter or buffer value of the module; tied names share one key (and one value)."""

    key: int
    names: tuple[str, ...]  # qualified names, parameters first; tied ones together
    ref: TensorRef

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.ref.size)

    @property
    def dtype(self) -> torch.dtype:
        return self.ref.dtype


# What replay hands over once its storage is final: a parameter or buffer value (to the caller), or an attribute tensor
# (given its value in place; see [Note: attribute tensors] in attribute_tensors.py).
Emission = FinalTensor | AttributeTensor


@dataclass(slots=True)
class Step:
    """One replay step: an op (or `None` for the emission of `emits`), with what the liveness pass decided."""

    op: RecordedOp | None
    emits: tuple[Emission, ...] = ()
    run: bool = True  # False: the op neither draws random numbers nor writes anything read later
    scratch: frozenset[int] = frozenset()  # storages this op writes but whose result nobody reads
    release: frozenset[int] = field(default_factory=frozenset)  # real storages not needed after this step


def final_tensors(module: nn.Module, recording: Recording) -> tuple[FinalTensor, ...]:
    """The module's meta parameters and buffers, grouped so that tied tensors share one key. A tensor-parallel
    parameter's value is the whole tensor it was distributed from (see [Note: tensor-parallel parameters built on
    the meta device] in distributed_origins.py)."""
    groups: dict[TensorRef, list[str]] = {}
    writes: tuple[dict[int, int], dict[int, int]] | None = None  # see _last_writes; once a DTensor needs them
    named: Iterator[tuple[str, Tensor]] = (
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    )  # type: ignore[assignment]
    for name, tensor in named:
        if not tensor.is_meta:
            continue  # made on a real device by the build itself: it already holds its value
        if is_distributed(tensor):
            writes = writes if writes is not None else _last_writes(recording)
            groups.setdefault(_distributed_origin(name, tensor, recording, writes), []).append(name)
            continue
        if recording.storage_id(tensor) is None:
            raise DeferredInitError(
                f"{name} is a meta tensor that record_construction never saw being made: create the module "
                f"inside the recording (not before it, and not under another meta-device context). If code after "
                f"the build remade it on the meta device (litgpt's pretraining runs reset_parameters() on the meta "
                f"model, as FSDP expects), set meta_init='reset_parameters': the strategy then calls every "
                f"reset_parameters() itself when it shards the model."
            )
        groups.setdefault(recording.ref(tensor), []).append(name)
    return tuple(FinalTensor(key, tuple(names), ref) for key, (ref, names) in enumerate(groups.items()))


def _last_writes(recording: Recording) -> tuple[dict[int, int], dict[int, int]]:
    """storage -> index of the last op writing it; id(op) -> its index."""
    last = {sid: index for index, op in enumerate(recording.ops) for sid in op.writes}
    return last, {id(op): index for index, op in enumerate(recording.ops)}


def _distributed_origin(
    name: str, tensor: Tensor, recording: Recording, writes: tuple[dict[int, int], dict[int, int]]
) -> TensorRef:
    """The whole tensor a DTensor parameter was distributed from; refused when there is none, or when the build
    wrote the DTensor, or that tensor, after the distribution (the DTensor's values are then not a block of the
    tensor's final value)."""
    origin = recording.distributed.of(tensor)
    if origin is None:
        raise DeferredInitError(
            f"{name} is a tensor-parallel (DTensor) parameter on the meta device that was not distributed from a "
            f"parameter built inside the recording: build the module and apply its plan (parallelize_module) in "
            f"configure_model() (or build it under Trainer.init_module(empty_init=True) and apply the plan in "
            f"configure_model(); under Fabric, build it under fabric.init_module(empty_init=True) and apply the "
            f"plan with parallelize_fn), or build it eagerly."
        )
    written, index_of = writes
    after = {recording.storage_id(tensor), recording.storage_id(local_part(tensor))} - {origin.ref.storage, None}
    # the op found by identity: generator steps inserted into the ops since would shift a remembered index
    distributed_at = index_of.get(id(origin.after), -1)
    if any(sid in written for sid in after) or written.get(origin.ref.storage, -1) > distributed_at:
        raise DeferredInitError(
            f"{name} was changed after the tensor-parallel plan distributed it (an initialization of the DTensor "
            f"parameter on the meta device, or of the parameter it replaced): its values can only be replayed from "
            f"the parameter as the plan distributed it. Initialize the parameters before applying the plan, or "
            f"build the model eagerly."
        )
    return origin.ref


def schedule_steps(recording: Recording, emissions: tuple[Emission, ...]) -> list[Step]:
    """Orders the ops and emissions, then runs the backward liveness pass over them.

    A final value is emitted right after the last op that writes its storage. See [Note: replay liveness].
    """
    last_write: dict[int, int] = {}
    for index, op in enumerate(recording.ops):
        for sid in op.writes | op.created_storages:
            last_write[sid] = index
    emits_after: dict[int, list[Emission]] = {}
    for emission in emissions:
        emits_after.setdefault(last_write.get(emission.ref.storage, -1), []).append(emission)
    steps = [Step(None, tuple(emits_after.get(-1, ())))]
    for index, op in enumerate(recording.ops):
        steps.append(Step(op))
        if index in emits_after:
            steps.append(Step(None, tuple(emits_after[index])))
    _mark_liveness(steps)
    return steps


# [Note: replay liveness]
# Walking backwards, `live` holds the storages whose current value a later step reads. An op runs if it draws
# random numbers (the generator must advance exactly as in eager) or writes a live storage. Its dead writes go
# to scratch storage allocated for that op only: a random op's draw count depends on the op, shape and dtype,
# never on the destination's old values. An op that covers a storage without reading it (uniform_, fill_,
# copy_, out=, a creation) ends that value's life going backwards, so a parameter re-initialized later holds
# real memory only from its last overwrite to its emission: peak memory is a few tensors, not the model.
def _mark_liveness(steps: list[Step]) -> None:
    live: set[int] = set()
    for step in reversed(steps):
        if step.op is None:
            sids = {final.ref.storage for final in step.emits}
            step.release = frozenset(sids - live)
            live |= sids
            continue
        op = step.op
        written = op.writes | op.created_storages
        live_writes = written & live
        if not (op.random or live_writes):
            step.run = False
            continue
        reads = op.reads - (written - live_writes)  # a dead partial write's old value is not needed either
        step.scratch = frozenset(written - live_writes)
        step.release = frozenset((live_writes | reads) - live)
        live -= op.overwrites | op.created_storages
        live |= reads
    if live:
        raise DeferredInitError(
            f"the build reads {len(live)} meta tensor(s) made outside record_construction, whose values are "
            f"unknown: create every tensor the model uses inside the recording."
        )
