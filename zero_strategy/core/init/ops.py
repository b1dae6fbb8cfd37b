"""What a recording holds: recorded tensors described by storage and view, and the ops that touched them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

aten = torch.ops.aten


class DeferredInitError(RuntimeError):
    """Construction on the meta device did something that record-and-replay cannot reproduce exactly."""


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A recorded meta tensor: the storage it lives in (an id of the recording) and its view of it.

    Views need no op of their own on replay: the same geometry on the replayed storage is the same view.
    """

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of `dtype`

    @property
    def nbytes(self) -> int:
        numel = 1
        for extent in self.size:
            numel *= extent
        return numel * self.dtype.itemsize

    def covers(self, storage_nbytes: int) -> bool:
        """Whether writing this view writes every byte of its storage exactly once."""
        if self.offset != 0 or self.nbytes != storage_nbytes:
            return False
        expected = 1
        for extent, step in sorted(zip(self.size, self.stride, strict=True), key=lambda pair: pair[1]):
            if extent == 1:
                continue
            if step != expected:
                return False
            expected *= extent
        return True


@dataclass(frozen=True, slots=True)
class RealRef:
    """A real (non-meta) tensor an op read during recording, kept by reference; its version must not move."""

    tensor: Tensor
    version: int


@dataclass(slots=True)
class RecordedOp:
    """One recorded call: an aten op, a whole `torch.nn.init` function replayed as a black box, or a generator
    step (a state set or captured: see [Note: reseeds inside the build] in generators.py) called with no arguments.

    `args`/`kwargs` hold `TensorRef`/`RealRef` where the call had tensors.
    """

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    writes: frozenset[int]  # storages written in place (or as out=)
    overwrites: frozenset[int]  # subset of writes: every byte written, previous value not read
    reads: frozenset[int]  # storages whose values the op reads (partial writes included)
    creates: tuple[tuple[int, TensorRef], ...]  # (position in flattened output, new storage's ref)
    random: bool  # draws from a generator (or sets or captures its state): must run even when its result is dead
    where: str  # the module code that issued it, for error messages

    @property
    def created_storages(self) -> frozenset[int]:
        return frozenset(ref.storage for _, ref in self.creates)


# In-place ops whose result does not depend on the destination's previous values (when they cover it).
_OVERWRITING = frozenset(
    {
        aten.uniform_,
        aten.normal_,
        aten.fill_,
        aten.zero_,
        aten.copy_,
        aten.random_,
        aten.bernoulli_,
        aten.exponential_,
        aten.geometric_,
        aten.log_normal_,
        aten.cauchy_,
    }
)

# Random ops whose schema has no Generator argument and that carry no `nondeterministic_seeded` tag.
_RANDOM_WITHOUT_TAG = frozenset({aten.native_dropout, aten.rand_like, aten.randn_like, aten.randint_like})


def is_random(func: torch._ops.OpOverload) -> bool:
    """Whether an aten op draws from a random generator (so its consumption must be replayed)."""
    if torch.Tag.nondeterministic_seeded in func.tags or func.overloadpacket in _RANDOM_WITHOUT_TAG:
        return True
    return any("Generator" in str(arg.type) for arg in func._schema.arguments)


def overwrites_destination(func: torch._ops.OpOverload, arg_name: str) -> bool:
    """Whether writing `arg_name` ignores its previous value (out= arguments and the `_OVERWRITING` ops)."""
    if func.overloadpacket in _OVERWRITING and arg_name == "self":
        return True
    return any(arg.name == arg_name and arg.is_out for arg in func._schema.arguments)
