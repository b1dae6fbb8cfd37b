"""The benchmark's methods: how DDP, ZeroRedundancyOptimizer, FSDP2, ZeRO (and DeepSpeed, where installed) are
set up on one rank, and the counter that records what each of them sends."""

from __future__ import annotations

import functools
import importlib.util
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine import ZeroEngine
from zero_strategy.tools.bench_model import BenchGPT

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
        installs those too (DeepSpeed: :mod:`zero_strategy.tools.bench_deepspeed`)."""
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
    backward: Callable[[Tensor], object] = Tensor.backward  # DeepSpeed: its engine's backward
    # (parameters, gradients, optimizer state) bytes, for a method that keeps its model state in buffers that the
    # generic walk of parameters, `.grad` and `state_optimizer.state` cannot see (DeepSpeed's flat partitions).
    state_walk: Callable[[], tuple[int, int, int]] | None = None


def _build_ddp(model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    from torch.nn.parallel import DistributedDataParallel

    # Gradients as views of DDP's buckets: otherwise the buckets are a second full gradient (20Ψ, not 16Ψ) that
    # no walk of `.grad` sees.
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LEARNING_RATE)
    return MethodRun(ddp, model, optimizer, optimizer.step, optimizer)


def _build_zero(stage: int, model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))

    def step() -> None:
        engine.prepare_step(optimizer)
        optimizer.step()
        engine.after_step(optimizer)

    return MethodRun(model, model, optimizer, step, optimizer, engine)


def _build_zero_redundancy(model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _build_ddp(model, counter).forward_module
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)
    return MethodRun(ddp, model, optimizer, optimizer.step, optimizer.optim)


def _build_fsdp2(reshard_after_forward: bool, model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    assert isinstance(model, BenchGPT)
    for block in model.blocks:  # the same units as ZeRO's: one per block, the rest in the root
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    return MethodRun(model, model, optimizer, optimizer.step, optimizer)


def _build_deepspeed(stage: int, model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    # Imported here, in the rank process: bench_deepspeed imports this module, and deepspeed itself is imported
    # only by a deepspeed run.
    from zero_strategy.tools.bench_deepspeed import build_deepspeed

    return build_deepspeed(stage, model, counter)


BUILDERS: dict[str, Callable[[nn.Module, CollectiveCounter], MethodRun]] = {
    "ddp": _build_ddp,
    "zero1": functools.partial(_build_zero, 1),
    "zero2": functools.partial(_build_zero, 2),
    "zero3": functools.partial(_build_zero, 3),
    "zero_redundancy": _build_zero_redundancy,
    "fsdp2_reshard_false": functools.partial(_build_fsdp2, False),
    "fsdp2_reshard_true": functools.partial(_build_fsdp2, True),
}

# DeepSpeed's rows exist only where it is installed (it is no dependency of this package). They stay in the default
# method list there: each run is its own row, so a DeepSpeed failure shows as "n/a (...)" and the other rows stand.
if importlib.util.find_spec("deepspeed") is not None:
    BUILDERS.update({f"deepspeed_zero{stage}": functools.partial(_build_deepspeed, stage) for stage in (1, 2, 3)})
