"""Replay: run a recording's live ops on real storage, hand each final value over, free it, count the bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from zero_strategy.core.init.attribute_tensors import AttributeTensor, attribute_tensors
from zero_strategy.core.init.ops import DeferredInitError, RealRef, RecordedOp, TensorRef
from zero_strategy.core.init.record import Recording
from zero_strategy.core.init.replay_steps import FinalTensor, Step, final_tensors, schedule_steps

OnFinal = Callable[[FinalTensor, Tensor], None]


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """What a replay did. `peak_bytes` counts the real storages the replay itself kept at once."""

    peak_bytes: int
    ops_run: int
    ops_on_scratch: int
    ops_skipped: int


class ModuleReplay:
    """A recording prepared for one module: its final tensors (keys), the tensors it holds besides them, and the
    liveness of every op."""

    def __init__(self, recording: Recording, module: nn.Module) -> None:
        self.recording = recording
        self.tensors = final_tensors(module, recording)
        self.attributes: tuple[AttributeTensor, ...] = attribute_tensors(module, recording)
        self._steps = schedule_steps(recording, (*self.tensors, *self.attributes))

    def key_of(self, name: str) -> int:
        """The key of a parameter's or buffer's qualified name (tied names share a key)."""
        for final in self.tensors:
            if name in final.names:
                return final.key
        raise KeyError(f"{name} is not a meta parameter or buffer of the planned module")

    def replay(self, on_final: OnFinal) -> ReplayStats:
        """Runs the construction again on real tensors; `on_final(tensor, value)` gets each parameter and buffer
        value once, and every attribute tensor gets its value in place (see [Note: attribute tensors] in
        attribute_tensors.py).

        The generators start from the recorded states and end where an eager build leaves them. `value` is never
        written again; the callback may keep it or copy what it needs (a slice), after which replay drops it.
        """
        return _Replayer(self.recording).run(self._steps, on_final)


class _Replayer:
    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.device = recording.device
        self.live: dict[int, torch.UntypedStorage] = {}  # storage id -> real storage, while live
        self.live_bytes = 0
        self.peak_bytes = 0

    def run(self, steps: list[Step], on_final: OnFinal) -> ReplayStats:
        self.recording.generators.restore()
        run = scratch = 0
        with torch.no_grad():
            for step in steps:
                if step.op is None:
                    for emission in step.emits:
                        value = self._view(self.live, emission.ref)
                        if isinstance(emission, AttributeTensor):
                            emission.fill(value)
                        else:
                            on_final(emission, value)
                elif step.run:
                    self._run_op(step.op, step.scratch)
                    run += 1
                    scratch += bool(step.scratch)
                for sid in step.release:
                    self._drop(sid)
        assert not self.live, f"replay left storages {sorted(self.live)} live"
        return ReplayStats(self.peak_bytes, run, scratch, len(steps) - run - sum(s.op is None for s in steps))

    def _run_op(self, op: RecordedOp, scratch_ids: frozenset[int]) -> None:
        scratch: dict[int, torch.UntypedStorage] = {}
        for sid in op.writes:
            if sid in scratch_ids:
                scratch[sid] = self._allocate(sid, live=False)
            elif sid not in self.live:  # the live range starts with an op that covers the storage
                self.live[sid] = self._allocate(sid, live=True)

        def real(value: Any) -> Any:
            if isinstance(value, TensorRef):
                return self._view(scratch if value.storage in scratch else self.live, value)
            if isinstance(value, RealRef):
                if value.tensor._version != value.version:
                    raise DeferredInitError(
                        f"a real tensor copied into the model ({op.where}) was modified in place after the copy; "
                        f"replay would read the new values. Copy a tensor that is not changed afterwards."
                    )
                return value.tensor
            if isinstance(value, torch.device) and value.type == "meta":
                return self.device
            return value

        out = op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + sum(s.nbytes() for s in scratch.values()))
        flat_out, _ = tree_flatten(out)
        for index, ref in op.creates:
            self._adopt(ref, flat_out[index], keep=ref.storage not in scratch_ids)

    def _adopt(self, ref: TensorRef, value: Tensor, keep: bool) -> None:
        """Takes a new output's storage, copied into the recorded layout if the real kernel chose another."""
        nbytes = self.recording.storage_nbytes[ref.storage]
        storage = value.untyped_storage()
        same_layout = (
            (tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype)
            == (ref.size, ref.stride, ref.offset, ref.dtype)
            and storage.nbytes() == nbytes
            and all(storage._cdata != live._cdata for live in self.live.values())
        )
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + storage.nbytes())
        if not keep:
            return
        if not same_layout:
            fresh = torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
            self._view({ref.storage: fresh}, ref).copy_(value)
            storage = fresh
        self.live[ref.storage] = storage
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _allocate(self, sid: int, live: bool) -> torch.UntypedStorage:
        nbytes = self.recording.storage_nbytes[sid]
        if live:
            self.live_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()

    def _drop(self, sid: int) -> None:
        if self.live.pop(sid, None) is not None:
            self.live_bytes -= self.recording.storage_nbytes[sid]

    def _view(self, storages: dict[int, torch.UntypedStorage], ref: TensorRef) -> Tensor:
        tensor = torch.empty(0, dtype=ref.dtype, device=self.device)
        return tensor.set_(storages[ref.storage], ref.offset, ref.size, ref.stride)


def materialize_module(module: nn.Module, recording: Recording) -> ReplayStats:
    """Gives every meta parameter and buffer of `module` real storage holding the replayed value (and every
    tensor it holds besides them, in place).

    Parameter objects keep their identity (optimizers and tied modules hold them); tied names stay one tensor.
    """
    plan = ModuleReplay(recording, module)
    values: dict[int, Tensor] = {}
    stats = plan.replay(lambda final, value: values.__setitem__(final.key, value))
    params = dict(module.named_parameters(remove_duplicate=False))
    swapped: set[int] = set()
    for final in plan.tensors:
        for name in final.names:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if name in params:
                param = params[name]
                if id(param) not in swapped:
                    swapped.add(id(param))
                    replacement = nn.Parameter(values[final.key], requires_grad=param.requires_grad)
                    torch.utils.swap_tensors(param, replacement)
            else:
                owner._buffers[attr] = values[final.key]
    return stats
