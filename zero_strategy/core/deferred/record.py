"""Recording: construction runs on the meta device while every op that makes or changes a tensor is written down."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from zero_strategy.core.deferred.generators import GeneratorStates, RestoreState
from zero_strategy.core.deferred.ops import (
    DeferredInitError,
    RealRef,
    RecordedOp,
    TensorRef,
    is_random,
    overwrites_destination,
)
from zero_strategy.core.deferred.profile_hook import profile_hook
from zero_strategy.core.deferred.where import module_code_in_frames, rng_remedy

aten = torch.ops.aten
_META = torch.device("meta")
_DATA_CONSTRUCTORS = (torch.tensor, torch.as_tensor, torch.asarray)
_DATA_DEPENDENT = frozenset({aten._local_scalar_dense, aten.equal, aten.is_nonzero})


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

    @property
    def made_tensors(self) -> bool:
        """Whether the build made any tensor on the meta device. One that only reseeded (configure_model running
        again on a built model, seeding before its guard) has nothing to replay: its reseeds ran for real, and
        recording leaves each generator at the last state the build set, as an eager build does."""
        return bool(self.storage_nbytes)

    def storage_id(self, tensor: Tensor) -> int | None:
        """The recording's id of a meta tensor's storage, or None if the recording never saw it."""
        return self._ids.get(tensor.untyped_storage()._cdata)

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


class _RecordOps(TorchDispatchMode):
    """Sees every aten op while recording; records those that touch meta tensors."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        touches_meta = any(isinstance(v, Tensor) and v.is_meta for v in flat_in) or kwargs.get("device") == _META
        if touches_meta and func.overloadpacket in _DATA_DEPENDENT:
            raise DeferredInitError(
                f"{func} reads a tensor's value ({module_code_in_frames(sys._getframe(1))}), but construction on "
                f"the meta device has no values: initialization must not read tensor values (.item(), .tolist(), "
                f"bool(tensor), numpy). Build this model eagerly, or move that code to reset_parameters() or a "
                f"hook that runs after setup."
            )
        if not touches_meta and is_random(func) and self.recording._black_box_frame is None:
            raise DeferredInitError(
                f"{func} drew random numbers for a real (non-meta) tensor during construction on the meta device "
                f"({module_code_in_frames(sys._getframe(1))}); replay could not reproduce them. {rng_remedy()}"
            )
        out = func(*args, **kwargs)
        if self.recording._black_box_frame is not None:  # part of a call recorded as a whole
            return out
        if touches_meta or any(isinstance(v, Tensor) and v.is_meta for v in tree_flatten(out)[0]):
            self.recording.record(func, args, kwargs, out)
        return out


# `torch.get_default_device()` answers "cpu" by making `torch.tensor([])` and reading its device. Under the
# recording that probe would say "meta", and code that stores the answer (a torchmetrics Metric's `device`, used
# to place tensors after the build) would keep placing them on the meta device: the probe is left alone.
_DEFAULT_DEVICE_PROBE = next(
    (
        code
        for code in torch.get_default_device.__code__.co_consts
        if isinstance(code, types.CodeType) and code.co_name == "_get_device_with_index"
    ),
    None,
)


class _DefaultToMeta(TorchFunctionMode):
    """Like `torch.device("meta")`, except that tensors made from data keep their values (a recorded copy)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if sys._getframe(1).f_code is _DEFAULT_DEVICE_PROBE:
            return func(*args, **kwargs)
        if func is Tensor.new_tensor and args[0].is_meta and kwargs.get("device") is None:
            kwargs.setdefault("dtype", args[0].dtype)
            return torch.tensor(args[1], **kwargs, device="cpu").to(_META)
        if func in _device_constructors() and kwargs.get("device") is None:
            holds_meta = any(isinstance(v, Tensor) and v.is_meta for v in tree_flatten((args, kwargs))[0])
            if func in _DATA_CONSTRUCTORS and not holds_meta:
                # torch.tensor(data, device="meta") would drop the data without any op to record.
                return func(*args, **{**kwargs, "device": "cpu"}).to(_META)
            kwargs["device"] = _META
        return func(*args, **kwargs)


@contextmanager
def record_construction(device: torch.device | str = "cpu") -> Iterator[Recording]:
    """Build under this context: tensors land on the meta device and the returned recording can replay them.

    `device` is where the values will be replayed; its default generator is the one the build draws from,
    exactly as an eager build on that device would.
    """
    recording = Recording(torch.device(device))
    with _recording_into(recording):
        yield recording


@contextmanager
def continue_recording(recording: Recording, where: str) -> Iterator[Recording]:
    """Record more ops on the meta tensors of an earlier recording (and new ones), as if they followed its build
    at this moment: replay runs them after the build's, each tracked generator first set to the state it has now
    (rank 0's, once the ranks agree), whatever moved it since the build ended."""
    for generator in recording.generators.tracked():
        recording.record_set_state(generator, where)
    with _recording_into(recording):
        yield recording


@contextmanager
def _recording_into(recording: Recording) -> Iterator[None]:
    try:
        with profile_hook(recording), _DefaultToMeta(), _RecordOps(recording):
            yield
        recording.check_generators("detected when the build finished")
    except DeferredInitError:
        raise
    except (RuntimeError, NotImplementedError, TypeError) as error:
        if "meta" not in str(error):
            raise
        raise DeferredInitError(
            f"construction on the meta device failed ({module_code_in_frames(_innermost_frame(error))}): "
            f"{error}. Initialization must not read tensor values (.item(), .tolist(), numpy, copying to the "
            f"host). Build this model eagerly, or move that code to reset_parameters() or a hook that runs "
            f"after setup."
        ) from error
    finally:
        recording.generators.finish()


def _innermost_frame(error: BaseException) -> types.FrameType | None:
    traceback = error.__traceback__
    frame = None
    while traceback is not None:
        frame = traceback.tb_frame
        traceback = traceback.tb_next
    return frame
