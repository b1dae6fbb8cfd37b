"""Recording: the ops of one construction on the meta device, in order, as the replay will run them (what writes
them down while the model is built is capture.py)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from zero_strategy.core.init.distributed_origins import DistributedOrigins
from zero_strategy.core.init.generators import GeneratorStates, RestoreState
from zero_strategy.core.init.ops import (
    DeferredInitError,
    RealRef,
    RecordedOp,
    TensorRef,
    is_random,
    overwrites_destination,
)
from zero_strategy.core.init.where import module_code_in_frames, rng_remedy


class Recording:
    """The ops of one construction, in order (reseeds included), with the generator states they start from."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ops: list[RecordedOp] = []
        self.storage_nbytes: dict[int, int] = {}  # recorded storage id -> bytes
        self.generators = GeneratorStates(device)
        self._ids: dict[int, int] = {}  # StorageImpl address -> storage id
        self._alive: list[torch.UntypedStorage] = []  # keeps meta storages alive so addresses are never reused
        self._black_box_frame: types.FrameType | None = None
        # tensor-parallel parameters made from recorded ones (see [Note: tensor-parallel parameters built on the
        # meta device] in distributed_origins.py)
        self.distributed = DistributedOrigins()

    @property
    def made_tensors(self) -> bool:
        """Whether the build made any tensor on the meta device. One that only reseeded (configure_model running
        again on a built model, seeding before its guard) has nothing to replay: its reseeds ran for real, and
        recording leaves each generator at the last state the build set, as an eager build does."""
        return bool(self.storage_nbytes)

    def storage_id(self, tensor: Tensor) -> int | None:
        """The recording's id of a meta tensor's storage, or None if the recording never saw it."""
        return self._ids.get(tensor.untyped_storage()._cdata)

    def recorded_ref(self, tensor: Tensor) -> TensorRef | None:
        """``tensor``'s ref if it is a meta tensor whose storage the recording saw, else None."""
        return self.ref(tensor) if tensor.is_meta and self.storage_id(tensor) is not None else None

    def last_op(self) -> RecordedOp | None:
        return self.ops[-1] if self.ops else None

    def ref(self, tensor: Tensor) -> TensorRef:
        storage = tensor.untyped_storage()
        sid = self._ids.get(storage._cdata)
        if sid is None:  # made before recording began (or by code the recording does not see)
            sid = len(self.storage_nbytes)
            self._ids[storage._cdata] = sid
            self._alive.append(storage)
            self.storage_nbytes[sid] = storage.nbytes()
        size, stride = tuple(tensor.shape), tuple(tensor.stride())
        return TensorRef(sid, tensor.dtype, size, stride, int(tensor.storage_offset()))

    def _new_storage(self, tensor: Tensor) -> TensorRef | None:  # None: an existing storage (a view)
        if tensor.untyped_storage()._cdata in self._ids:
            return None
        return self.ref(tensor)

    def check_generators(self, where: str) -> None:
        """Meta ops draw nothing, so each generator must still be where the last recorded reseed left it."""
        generator = self.generators.changed_unseen()
        if generator is not None:
            which = "default" if generator is self.generators.default else "explicit"
            raise DeferredInitError(
                f"the {which} {generator.device.type} random generator's state changed during construction on the "
                f"meta device ({where}) by something other than a reseed (a random op on a real tensor, or a "
                f"state set outside Python): replay could not reproduce the values an eager build gets. "
                f"{rng_remedy()}"
            )

    def record_set_state(self, generator: torch.Generator, where: str) -> None:
        """A reseeding method of `generator` returned: the new state becomes a step of the recording (see [Note:
        reseeds inside the build] in generators.py)."""
        if self.generators.moving or not self.generators.tracks(generator):
            return
        placeholder = self.generators.after_set(generator)
        if placeholder is None:
            self._append_generator_step(self.generators.set_states[-1], where)
            return
        if not placeholder.captured:  # the capture goes right after the op whose draws it must include
            index = next(i for i, op in enumerate(self.ops) if op is placeholder.after)
            self.ops.insert(index + 1, _generator_step(placeholder.capture, placeholder.after.where))
            placeholder.captured = True
        self._append_generator_step(RestoreState(generator, placeholder.capture), where)

    def check_seed_read(self, generator: torch.Generator, where: str) -> None:
        """`initial_seed()` was read: refused while the generator holds a placeholder state (its value would be
        the placeholder's seed, not the seed an eager build reads)."""
        if self.generators.tracks(generator) and self.generators.placeholder_of(generator) is not None:
            raise DeferredInitError(
                f"initial_seed() was read after random numbers were drawn inside the build on the meta device "
                f"({where}): record-and-replay has no generator state to read there. Read it before the build, or "
                f"build this model eagerly."
            )

    def _append_generator_step(self, step: Callable[[], None], where: str) -> None:
        self.ops.append(_generator_step(step, where))

    def record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Write down one aten op whose inputs or outputs include meta tensors."""
        written, reads = self._effects(func, args, kwargs)
        flat_out, _ = tree_flatten(out)
        creates = tuple(
            (index, ref)
            for index, value in enumerate(flat_out)
            if isinstance(value, Tensor) and value.is_meta and (ref := self._new_storage(value)) is not None
        )
        self._append(func, args, kwargs, written, reads, creates, is_random(func))  # type: ignore[arg-type]

    def _effects(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[int, bool], frozenset[int]]:
        """Storages an op writes (-> whether fully overwritten) and storages whose values it reads."""
        schema_args = func._schema.arguments
        bound = dict(zip((a.name for a in schema_args), args, strict=False)) | kwargs
        writes_arg = {a.name for a in schema_args if a.alias_info is not None and a.alias_info.is_write}
        written: dict[int, bool] = {}
        for name in writes_arg:
            for value in _meta_tensors(bound.get(name)):
                ref = self.ref(value)
                full = overwrites_destination(func, name) and ref.covers(self.storage_nbytes[ref.storage])
                written[ref.storage] = written.get(ref.storage, True) and full
        reads = set()
        for name, argument in bound.items():
            for value in _meta_tensors(argument):  # a tensor, or a list of them (cat, stack)
                sid = self.ref(value).storage
                if name not in writes_arg or not written[sid]:  # a partial write keeps (reads) the rest
                    reads.add(sid)
        return written, frozenset(reads)

    def record_black_box(self, fn: Callable[..., Any], bound: dict[str, Any], where: str) -> None:
        """Write down a whole `torch.nn.init` call (see [Note: nn.init functions that skip meta tensors])."""
        tensors = [value for value in bound.values() if isinstance(value, Tensor) and value.is_meta]
        written = {}
        for tensor in tensors[:1]:  # these functions fill their first tensor argument
            ref = self.ref(tensor)
            written[ref.storage] = ref.covers(self.storage_nbytes[ref.storage])
        reads = frozenset(self.ref(t).storage for t in tensors[1:]) | {s for s, full in written.items() if not full}
        self._append(fn, (), bound, written, reads, (), True, where)

    def _append(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        written: dict[int, bool],
        reads: frozenset[int],
        creates: tuple[tuple[int, TensorRef], ...],
        random: bool,
        where: str | None = None,
    ) -> None:
        where = where or module_code_in_frames(sys._getframe(2))
        values = tree_flatten((args, kwargs))[0]
        if random:
            self.check_generators(where)
        self.generators.note_used(values)
        op = RecordedOp(
            func=func,
            args=tree_map(self._describe, args),
            kwargs=tree_map(self._describe, kwargs),
            writes=frozenset(written),
            overwrites=frozenset(s for s, full in written.items() if full),
            reads=reads,
            creates=creates,
            random=random,
            where=where,
        )
        self.ops.append(op)
        if random:
            self.generators.after_random_op(self.generators.drawn_from(values), op)

    def _describe(self, value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        if value.is_meta:
            return self.ref(value)
        return RealRef(value, value._version)


def _meta_tensors(argument: Any) -> list[Tensor]:
    return [value for value in tree_flatten(argument)[0] if isinstance(value, Tensor) and value.is_meta]


def _generator_step(step: Callable[[], None], where: str) -> RecordedOp:
    """A replay step that sets or captures a generator's state: it writes no tensor, and always runs."""
    nothing: frozenset[int] = frozenset()
    return RecordedOp(step, (), {}, nothing, nothing, nothing, creates=(), random=True, where=where)
