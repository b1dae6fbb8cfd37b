"""The benchmark's rows on the paths users run: the same model and tokens under ``Trainer(strategy=...)`` and
``Fabric(strategy=...)``, for ZeRO's stages and for Lightning's own strategies (``ddp``, ``fsdp``,
``ModelParallelStrategy`` with FSDP2, ``deepspeed`` where it imports).

[Note: what a Trainer row times]
The Trainer runs its own loop, so a row's step is the time from one ``on_train_batch_start`` to the next: the whole
iteration a user pays for (the SIGTERM broadcast Lightning makes every step with more than one rank, the data fetch
of a ready tensor, the hooks, zero_grad, forward, backward, the optimizer step and the logging bookkeeping), where an
engine-level row times zero_grad, forward, backward and the step of a plain loop. The fit runs one step more than
the timed ones so that the last timed step has an end; the memory walk runs at that extra step's start (the last
timed step's gradients are still there: Lightning clears them inside the next step's closure), outside any timed
interval. Fabric rows run the engine-level loop itself (``benchmark._train``) through Fabric's wrappers.

Every row trains with the user's ``AdamW(lr=1e-3)``, fp32, no logger, no checkpointing, no progress bar, no
gradient clipping, no accumulation; the module logs nothing and reads no gradient (the case the issue asks to cost
nothing beyond the engine). Lightning's ``ddp`` rows use the benchmark's counting all-reduce hook (as the
engine-level ``ddp`` row does) so that their bytes are counted.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from benchmarks import bench_model
from benchmarks.bench_counter import LEARNING_RATE, CollectiveCounter, MethodRun, counting_allreduce_hook
from benchmarks.bench_model import Block, ModelShape, build_model
from benchmarks.bench_phases import PhaseClock


class BenchModule(pl.LightningModule):
    """The benchmark model as a LightningModule that logs nothing and reads no gradient."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.model = build_model(shape)

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return bench_model.lm_loss(self.model, batch)  # through the module: the phase timers wrap it there

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)


class FullyShardedBenchModule(BenchModule):
    """For ``ModelParallelStrategy``: FSDP2 on each block and on the root, the engine-level ``fsdp2`` rows' units."""

    @override
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None, "ModelParallelStrategy sets the device mesh before configure_model"
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class StepClock(Callback):
    """Times each step from one ``on_train_batch_start`` to the next (see [Note: what a Trainer row times])."""

    def __init__(self, warmup: int, steps: int, at_train_start: Callable[[pl.Trainer], None],
                 at_timing_start: Callable[[], None], at_end: Callable[[pl.Trainer], None]) -> None:
        self.warmup, self.steps = warmup, steps
        self.at_train_start = at_train_start
        self.at_timing_start, self.at_end = at_timing_start, at_end
        self.times: list[float] = []
        self.losses: list[float] = []
        self._last: float | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_train_start(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        if batch_idx > self.warmup and self._last is not None:
            self.times.append(now - self._last)
        if batch_idx == self.warmup:  # traffic counts (and phases time) from the first timed step, as in _train
            dist.barrier()
            self.at_timing_start()
        if batch_idx == self.warmup + self.steps:
            self.at_end(trainer)  # the extra step: nothing of it is timed
            dist.barrier()
        self._last = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx < self.warmup + self.steps:
            self.losses.append(float(outputs["loss"]))


def _ddp(counter: CollectiveCounter) -> Any:
    return "ddp"


def _fsdp(counter: CollectiveCounter) -> Any:
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy={Block})


def _model_parallel(counter: CollectiveCounter) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1)


def _zero(stage: int, counter: CollectiveCounter) -> Any:
    from zero_strategy import ZeroStrategy

    return ZeroStrategy(stage=stage)


def _deepspeed(stage: int, counter: CollectiveCounter) -> Any:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(stage=stage)


TRAINER_STRATEGIES: dict[str, Callable[[CollectiveCounter], Any]] = {
    "trainer_ddp": _ddp,
    "trainer_fsdp": _fsdp,
    "trainer_fsdp2": _model_parallel,
    **{f"trainer_zero{stage}": functools.partial(_zero, stage) for stage in (1, 2, 3)},
}
if importlib.util.find_spec("deepspeed") is not None:
    TRAINER_STRATEGIES.update({f"trainer_deepspeed_zero{s}": functools.partial(_deepspeed, s) for s in (1, 2, 3)})


def run_trainer(method: str, shape: ModelShape, batches: list[Tensor], warmup: int, counter: CollectiveCounter,
                clock: PhaseClock | None, walk: Callable[[MethodRun], dict[str, Any]]) -> dict[str, Any]:
    """Fit ``method``'s Trainer for ``len(batches)`` steps (the last one untimed); the result dict of ``_train``.
    ``clock``: a profiled run's phase timers, running over the timed steps."""
    from benchmarks.bench_compile import dynamo_counts

    module_class = FullyShardedBenchModule if method == "trainer_fsdp2" else BenchModule
    module = module_class(shape)
    memory: dict[str, Any] = {}
    engine_holder: list[Any] = []

    def timing_start() -> None:
        counter.bytes_by_kind.clear()
        if method.startswith("trainer_zero"):
            engine_holder.append(trainer.strategy.engine)  # type: ignore[attr-defined]
            engine_holder[0].comm_log.reset()
        if clock is not None:
            clock.start()

    def at_end(trainer: pl.Trainer) -> None:
        if clock is not None:
            memory["phases"] = clock.stop()
            memory["phase_steps"] = len(batches) - 1 - warmup
        # what the timed steps sent, before the extra step sends more
        memory["counted"] = dict(counter.bytes_by_kind)
        engine = engine_holder[0] if engine_holder else None
        if engine is not None:
            memory["engine_log"] = engine.comm_log.snapshot()
        optimizer = trainer.optimizers[0]
        assert trainer.strategy.model is not None
        run = MethodRun(trainer.strategy.model, module.model, optimizer, optimizer.step, optimizer, engine)
        memory.update(walk(run))

    def count_ddp_bytes(trainer: pl.Trainer) -> None:
        # Lightning registers a DDP comm hook on CUDA devices only: the counting hook goes on here, before the
        # first backward, as the engine-level ddp row's does
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(trainer.strategy.model, DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(counter, counting_allreduce_hook)

    step_clock = StepClock(warmup, len(batches) - 1 - warmup, count_ddp_bytes, timing_start, at_end)
    trainer = pl.Trainer(
        strategy=TRAINER_STRATEGIES[method](counter), accelerator="cpu", devices=dist.get_world_size(),
        max_steps=len(batches), callbacks=[step_clock], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    # each rank its own ready batches, in order: no sampler, no collation
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))  # type: ignore[arg-type]
    return {"times": step_clock.times, "losses": step_clock.losses, "dynamo": dynamo_counts(), **memory}


FABRIC_STRATEGIES: dict[str, Callable[[], Any]] = {
    "fabric_ddp": lambda: "ddp",
    **{f"fabric_zero{stage}": functools.partial(lambda s: f"zero{s}", stage) for stage in (1, 2, 3)},
}


def build_fabric(method: str, model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    """``fabric.setup(model, AdamW(...))`` under ``method``'s strategy; the loop is ``benchmark._train``'s."""
    import zero_strategy  # noqa: F401 (registers the zero names with Fabric)

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=FABRIC_STRATEGIES[method]())
    fabric.launch()  # the ranks exist already (LOCAL_RANK is set): nothing is started
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    wrapped, wrapped_optimizer = fabric.setup(model, optimizer)
    engine = None
    if method.startswith("fabric_zero"):
        engine = fabric.strategy.engine(wrapped)  # type: ignore[attr-defined]
    else:
        wrapped._forward_module.register_comm_hook(counter, counting_allreduce_hook)
    return MethodRun(wrapped, model, wrapped_optimizer, wrapped_optimizer.step, optimizer, engine,
                     backward=fabric.backward)


def as_launched_rank(rank: int, world_size: int) -> None:
    """What torchrun sets, for Lightning's environment detection (the process group exists already)."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))


def is_lightning_method(method: str) -> bool:
    return method in TRAINER_STRATEGIES or method in FABRIC_STRATEGIES


