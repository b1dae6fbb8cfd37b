"""The benchmark's methods: how DDP, ZeroRedundancyOptimizer, FSDP2, ZeRO (and DeepSpeed, where installed) are
set up on one rank, and the counter that records what each of them sends."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.bench_compile import compiled_blocks, compiled_whole
from benchmarks.bench_counter import LEARNING_RATE, CollectiveCounter, MethodRun, counting_allreduce_hook
from benchmarks.bench_deepspeed import build_deepspeed
from benchmarks.bench_model import BenchGPT
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine

# The compute floor: what each rank would do as a single process on its per-rank batch (no communication), with the
# fastest torch step (the fused AdamW kernel), so that every other row's time above it is what distribution adds.
# Its ranks run side by side like every other method's: one rank alone would get the machine's cores and memory
# bandwidth to itself, and the difference would show up as "communication" (5m preset on a busy 2-core machine:
# ~120 ms for one rank alone, ~230 ms for each of two side by side).
FLOOR = "single_process"


def _build_single_process(model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    return MethodRun(model, model, optimizer, optimizer.step, optimizer)


def _build_ddp(model: nn.Module, counter: CollectiveCounter, fused: bool | None = None) -> MethodRun:
    """DDP with the user's ``AdamW(...)`` (``fused=None``: torch's default, the per-tensor loop on CPU), or with
    ``AdamW(fused=True)``."""
    from torch.nn.parallel import DistributedDataParallel

    # Gradients as views of DDP's buckets: otherwise the buckets are a second full gradient (20Ψ, not 16Ψ) that
    # no walk of `.grad` sees.
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LEARNING_RATE, fused=fused)
    return MethodRun(ddp, model, optimizer, optimizer.step, optimizer)


def _build_zero(
    stage: int,
    model: nn.Module,
    counter: CollectiveCounter,
    unit_modules: list[str] | None = None,
    collectives: str = "auto",
) -> MethodRun:
    """``unit_modules``: ZeroConfig's (None: the default units, where the 30 M model's MLP layers, 1 M parameters
    each, are units of their own inside each block's unit). ``collectives``: ZeroConfig's."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)  # the user's, unmodified (ZeRO fuses it)
    config = ZeroConfig(stage=stage, unit_modules=unit_modules or [], collectives=collectives)
    engine = ZeroEngine(model, [optimizer], config)

    def step() -> None:
        engine.optimizer_step(optimizer)

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


BUILDERS: dict[str, Callable[[nn.Module, CollectiveCounter], MethodRun]] = {
    FLOOR: _build_single_process,
    "ddp": _build_ddp,
    "ddp_fused_adamw": functools.partial(_build_ddp, fused=True),
    "zero1": functools.partial(_build_zero, 1),
    "zero2": functools.partial(_build_zero, 2),
    "zero3": functools.partial(_build_zero, 3),
    "zero_redundancy": _build_zero_redundancy,
    "fsdp2_reshard_false": functools.partial(_build_fsdp2, False),
    "fsdp2_reshard_true": functools.partial(_build_fsdp2, True),
}

# Rows run only when named in --methods: torch.compile (benchmarks/bench_compile.py; compiling takes minutes here),
# zero3 with the blocks as its only units (the eager twin of zero3_block_units_compile), and zero1/2/3 with every
# exchange through gloo point-to-point (the same stage without shared memory).
OPT_IN_METHODS: dict[str, Callable[[nn.Module, CollectiveCounter], MethodRun]] = {
    "zero3_block_units": functools.partial(_build_zero, 3, unit_modules=["Block"]),
    # every exchange through gloo (no shared memory): what the shared-memory exchanges save, in the same run
    **{
        f"zero{stage}_point_to_point": functools.partial(_build_zero, stage, collectives="point_to_point")
        for stage in (1, 2, 3)
    },
    "ddp_compile": functools.partial(compiled_blocks, _build_ddp),
    "ddp_compile_whole": functools.partial(compiled_whole, _build_ddp),
    **{
        f"zero{stage}_compile": functools.partial(compiled_blocks, functools.partial(_build_zero, stage))
        for stage in (1, 2, 3)
    },
    # every unit a whole block: nothing inside a compiled block gathers, so nothing breaks its graph
    "zero3_block_units_compile": functools.partial(
        compiled_blocks, functools.partial(_build_zero, 3, unit_modules=["Block"])
    ),
}

# DeepSpeed's rows exist only where it is installed (it is no dependency of this package). They stay in the default
# method list there: each run is its own row, so a DeepSpeed failure shows as "n/a (...)" and the other rows stand.
if importlib.util.find_spec("deepspeed") is not None:
    BUILDERS.update({f"deepspeed_zero{stage}": functools.partial(build_deepspeed, stage) for stage in (1, 2, 3)})
