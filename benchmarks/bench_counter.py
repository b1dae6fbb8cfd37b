"""What every benchmark method reports through: the counter that records the bytes each collective moves, and
the :class:`MethodRun` a builder returns. Apart from the builders (:mod:`benchmarks.bench_methods`) so that the
DeepSpeed builder (:mod:`benchmarks.bench_deepspeed`) and the others import it without importing each other."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.core.engine.engine import ZeroEngine

LEARNING_RATE = 1e-3


SizeOf = Callable[[tuple[Any, ...], dict[str, Any]], int]


class CollectiveCounter:
    """Bytes per collective kind, recorded by the DDP comm hook and by wrappers around ``torch.distributed``."""

    # function → (kind, bytes it moves under the engine's convention, from its args and kwargs)
    _WRAPPED: ClassVar[dict[str, tuple[str, SizeOf]]] = {
        "all_reduce": ("all_reduce", lambda a, k: 2 * _nbytes(a[0] if a else k["tensor"])),
        "broadcast": ("broadcast", lambda a, k: _nbytes(a[0] if a else k["tensor"])),
        "all_gather_single": ("all_gather", lambda a, k: _nbytes(a[0] if a else k["output_tensor"])),
        "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(a[0] if a else k["output_tensor"])),
        "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(a[1] if len(a) > 1 else k["input"])),
        "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(a[1] if len(a) > 1 else k["input"])),
    }

    def __init__(self) -> None:
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self._originals: dict[tuple[Any, str], Callable[..., Any]] = {}  # (namespace, name) → original
        self._depth = 0  # a wrapped function calling another wrapped one is counted once

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes_by_kind[kind] += nbytes

    def install(self, namespace: Any = dist, table: dict[str, tuple[str, SizeOf]] | None = None) -> None:
        """Wrap the functions in this (forked, per-run) process only: ``table`` (default: the ones above) in
        ``namespace`` (default: ``torch.distributed``). A method whose library reaches collectives by other names
        installs those too (DeepSpeed: :mod:`benchmarks.bench_deepspeed`)."""
        for name, (kind, size_of) in (self._WRAPPED if table is None else table).items():
            original = getattr(namespace, name, None)
            if original is not None and (namespace, name) not in self._originals:
                self._originals[namespace, name] = original
                setattr(namespace, name, self._wrap(original, kind, size_of))

    def remove(self) -> None:
        for (namespace, name), original in self._originals.items():
            setattr(namespace, name, original)
        self._originals.clear()

    def _wrap(self, original: Callable[..., Any], kind: str, size_of: SizeOf) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.record(kind, size_of(args, kwargs))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def counting_allreduce_hook(counter: CollectiveCounter, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP's default averaging all-reduce, recording each bucket first. It calls the process group directly, so the
    ``dist.all_reduce`` wrapper does not count the same bucket again."""
    buffer = bucket.buffer()
    counter.record("all_reduce", 2 * _nbytes(buffer))
    group = dist.group.WORLD
    assert group is not None
    buffer.div_(group.size())
    return group.allreduce([buffer]).get_future().then(lambda fut: fut.value()[0])


# DDP compares the hook's annotations with the classes themselves; `from __future__ import annotations` made them
# strings, which it rejects.
counting_allreduce_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]})


@dataclass(slots=True)
class MethodRun:
    """One method set up on one rank: what forward calls, what steps, and where its state lives."""

    forward_module: nn.Module  # the wrapper a step's forward goes through (DDP, or the module itself)
    module: nn.Module  # the user's module (its parameters are walked)
    optimizer: Optimizer  # zero_grad goes here
    step: Callable[[], object]  # everything after backward: the optimizer step and the method's communication
    state_optimizer: Optimizer  # whose .state holds the optimizer state (ZeroRedundancyOptimizer: its local one)
    engine: ZeroEngine | None = None
    # DeepSpeed: its engine's backward. The default looks `backward` up at call time, where the phase timers of a
    # profiled run (benchmarks/bench_phases.py) find it.
    backward: Callable[[Tensor], object] = lambda loss: loss.backward()
    # (parameters, gradients, optimizer state) bytes, for a method that keeps its model state in buffers that the
    # generic walk of parameters, `.grad` and `state_optimizer.state` cannot see (DeepSpeed's flat partitions).
    state_walk: Callable[[], tuple[int, int, int]] | None = None
