"""ZeroStrategy: the Lightning adapter. It translates Lightning's hooks into ZeroEngine calls; no collectives here:
Lightning's own reduce/broadcast/barrier go to adapter_plumbing/process_group.py."""

from __future__ import annotations

import itertools
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from zero_strategy.adapter_plumbing.forward_entry import ForwardEntry
from zero_strategy.adapter_plumbing.process_group import (
    barrier,
    broadcast_object,
    destroy_after_spawned_run,
    init_process_group,
    rank_layout,
    reduce_tensor,
)
from zero_strategy.adapter_plumbing.process_per_device import ProcessPerDevice
from zero_strategy.adapter_plumbing.strategy_options import strategy_options
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import MemoryReport, memory_report
from zero_strategy.core.init.construction_recorder import ConstructionRecorder
from zero_strategy.core.plan.topology import RankLayout
from zero_strategy.core.runtime.activation_checkpointing import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from zero_strategy.deepspeed_import import DeepSpeedImport, parse_deepspeed_config
from zero_strategy.initial_values import initial_values, take_back_released
from zero_strategy.lightning.checkpoint_hooks import ShardedCheckpointHooks
from zero_strategy.lightning.deepspeed_bridge import apply_clipping, check_batch
from zero_strategy.lightning.gradient_hooks import holds_window_gradients
from zero_strategy.lightning.precision import ZeroPrecision
from zero_strategy.lightning.precision_selection import ZeroPrecisionChoice
from zero_strategy.lightning.preemption import install_preemption_saver
from zero_strategy.lightning.private_tensors import SHARING_START_METHODS, make_module_tensors_private
from zero_strategy.lightning.profiler import CommunicationProfiler
from zero_strategy.lightning.rank_exit import FinishMarkingLauncher
from zero_strategy.lightning.sharded_init import meta_parameters_stay, warn_parameters_stay_sharded
from zero_strategy.lightning.sharded_model import ModelState, ShardedModel
from zero_strategy.names import STRATEGY_NAMES


# ZeroPrecisionChoice: the precision plugin it runs with (its properties narrow Strategy's types, hence the ignore)
class ZeroStrategy(ZeroPrecisionChoice, ProcessPerDevice, ShardedCheckpointHooks):  # type: ignore[misc]
    """ZeRO sharded data parallelism (stage 1, 2 or 3) for any LightningModule.

    ``ZeroStrategy(stage=3)`` or ``Trainer(strategy="zero3")`` after ``import zero_strategy``. Options are the
    fields of :class:`zero_strategy.ZeroConfig`, given as keywords or as ``config=``.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int | None = None,
        *,
        config: ZeroConfig | None = None,
        start_method: str = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **options: Any,
    ) -> None:
        # Lightning's plumbing arguments are kept by name for compatibility with its connectors.
        resolved = strategy_options(stage, config, start_method, options)
        config = resolved.config
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.config = config
        self.checkpoint_io.checkpoint_format = config.checkpoint_format
        self._checkpoint_policy = resolved.checkpoint_policy
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._sharded = ShardedModel()  # the engine across runs (see [Note: saving after fit])
        self._recorder = ConstructionRecorder()
        self._pretrained_loaded = False
        self._layout: RankLayout | None = None  # nodes, shard and replica groups (see _rank_layout)
        self.deepspeed_import: DeepSpeedImport | None = None  # set by from_deepspeed_config
        self.take_over_precision_choice()  # built by the strategy registry inside a Trainer: see the method

    # ------------------------------------------------------------------------------------------ topology
    @property
    def start_method(self) -> str:
        """"popen" (the script re-run per rank, like ``ddp``) or a multiprocessing start method ("spawn", ...)."""
        return self._start_method

    @property
    def is_distributed(self) -> bool:
        # Lightning reads this for custom strategies: without it there is no DistributedSampler and
        # self.log(sync_dist=True) does not sync.
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            # Lightning's launcher, whose ranks leave a finished marker last (see [Note: finished markers])
            self._launcher = FinishMarkingLauncher(self, start_method=self._start_method)  # type: ignore[arg-type]

    @override
    def setup_environment(self) -> None:
        if self._start_method in SHARING_START_METHODS and self.lightning_module is not None:
            make_module_tensors_private(self.lightning_module)  # see [Note: tensors shared by spawn]
        super().setup_environment()
        reset_seed()
        self.assign_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, self._process_group_backend, self.config.process_group_timeout_s)
        self.build_device_mesh(self.root_device.type, self.world_size, self.lightning_module)

    # ------------------------------------------------------------------------------------------ optimizers
    @property
    @override
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]
        # Lightning's wrapper subclasses the optimizer's class, so `wrapper.zero_grad()` would run the class's
        # method and miss the engine's instance-level zero_grad (see [Note: zero_grad reaches the module's
        # gradients] in core/engine/optimizer.py). Each wrapper calls its optimizer's own zero_grad instead.
        for wrapper in self._lightning_optimizers:
            wrapper.zero_grad = partial(_zero_grad_of, wrapper.optimizer)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.lightning_module is not None
        self._recorder.materialize_if_nothing_to_shard(self.lightning_module)
        self.model_to_device()
        if self.deepspeed_import is not None:
            apply_clipping(self.deepspeed_import, trainer)
        callbacks: list = trainer.callbacks  # type: ignore[attr-defined]
        if self.config.profile and not any(isinstance(c, CommunicationProfiler) for c in callbacks):
            callbacks.append(CommunicationProfiler())
        if trainer.state.fn == TrainerFn.FITTING:
            install_preemption_saver(trainer)  # see [Note: preemption saves at a step boundary]
            self.setup_optimizers(trainer)
        self._shard_model()
        self.apply_pending_load()  # a checkpoint restored before setup loads its weights now (checkpoint_hooks.py)
        self.setup_precision_plugin()

    def _shard_model(self) -> None:
        module = self.lightning_module
        assert module is not None
        if self._sharded.state is ModelState.SHARDED:  # a run that did not tear down: start from a plain module again
            self._sharded.end()
        if self._checkpoint_policy is not None:
            apply_activation_checkpointing(module, self._checkpoint_policy, self.config.cpu_checkpointing)
        entry = ForwardEntry(module)
        trainer = module.trainer
        # Only a fit steps optimizers; validate/test/predict after a fit must not re-bind the fit's optimizers.
        optimizers = list(self.optimizers) if trainer.state.fn == TrainerFn.FITTING else []
        layout = self._rank_layout()
        recording = self._recorder.take()
        config = self.config if not self._pretrained_loaded else replace(self.config, pretrained=None)
        with initial_values(module, recording, config, self.root_device) as values:
            values = take_back_released(values, module, self._sharded.left_sharded(), self.root_device)
            policy = self.precision_plugin.policy()
            engine = ZeroEngine(module, optimizers, self.config, layout, entry, policy, initial_values=values)
        self._sharded.begin(engine)
        self._pretrained_loaded = True  # a later test()/validate() on this Trainer keeps the trained weights
        self.model = entry
        self.precision_plugin.attach(engine)
        self.checkpoint_io.attach(engine, str(self.precision_plugin.precision))

    def _rank_layout(self) -> RankLayout | None:
        """Nodes as the cluster environment defines them (global rank = node rank × processes per node + local
        rank), and the shard / replica groups of ``shard_group_size``; built once (the groups outlive fit/test)."""
        if self._layout is None:
            self._layout = rank_layout(self.config, self.world_size, self.num_processes, self._device_mesh)
        return self._layout

    @classmethod
    def from_deepspeed_config(
        cls, path_or_dict: str | os.PathLike | Mapping[str, Any], world_size: int | None = None, **kwargs: Any
    ) -> ZeroStrategy:
        """A strategy (with its ZeroPrecision) from a DeepSpeed JSON config. Batch keys are checked against
        ``world_size`` now if given, and against the Trainer and DataLoader when training starts; the config's
        ``gradient_clipping`` becomes the Trainer's ``gradient_clip_val``. Extra keywords go to ZeroStrategy."""
        imported = parse_deepspeed_config(path_or_dict, world_size=world_size)
        precision = ZeroPrecision(imported.precision, **imported.precision_kwargs)
        strategy = cls(precision_plugin=precision, **{**imported.zero_config_kwargs(), **kwargs})
        strategy.deepspeed_import = imported
        return strategy

    @override
    def on_train_start(self) -> None:
        if self.deepspeed_import is not None and self.lightning_module is not None:
            check_batch(self.deepspeed_import, self.lightning_module.trainer, self.world_size)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if any(t.is_meta for t in itertools.chain(self.model.parameters(), self.model.buffers())):
            return  # built on the meta device: the engine gives each unit its storage on root_device
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)``: build on the meta device, recording the construction (see
        [Note: sharded construction] in core/init/materialize.py); otherwise Lightning's default."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        if self._start_method in ("spawn", "forkserver"):
            # The recording refers to this process's meta storages by address: the copy a spawned worker unpickles
            # has other storages (and the recorded torch functions do not pickle), so no worker could replay it.
            raise RuntimeError(
                f"Trainer.init_module(empty_init=True) with start_method={self._start_method!r}: the model would be "
                "built on the meta device in this process, and the worker processes cannot replay that construction. "
                "Build the model in configure_model() (it runs in every worker), or use the plain launcher "
                "(e.g. strategy='zero3' instead of 'zero3_spawn')."
            )
        with self._recorder.recording_on(self.root_device), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()``: the model is built on the meta device and materialized unit by unit."""
        with self._recorder.recording_on(self.root_device):
            yield

    @override
    def teardown(self) -> None:
        if self._sharded.state is ModelState.SHARDED:
            if not self._sharded.end():  # the module's parameters stay sharded: see core/engine/release.py
                warn_parameters_stay_sharded(self.config.stage)
            if self.lightning_module is not None:
                remove_activation_checkpointing(self.lightning_module)
            self.precision_plugin.attach(None)
            self.checkpoint_io.attach(None, str(self.precision_plugin.precision))
            self.checkpoint_io.close()
        self.model = self.lightning_module
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        with meta_parameters_stay(self.lightning_module):  # Lightning's teardown moves the module to the CPU
            super().teardown()
        if self._start_method != "popen":
            destroy_after_spawned_run()  # a spawn-launched worker exits right after teardown

    # ------------------------------------------------------------------------------------- step plumbing
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """An accumulation window's micro-batches before its last: stages 2/3 keep their gradients on the module
        as ``keep_window_gradients`` decides (auto: where user code may read them, see lightning/gradient_hooks.py)."""
        module = self.lightning_module
        hold = module is not None and holds_window_gradients(module, self.config.keep_window_gradients)
        with self.engine.accumulation_window(hold=hold):
            yield

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return memory_report(self.engine)

    def communication_report(self) -> dict[str, int]:
        """Bytes sent per collective kind since the model was sharded (or the last ``reset``)."""
        return self.engine.comm_log.snapshot()

    # ---------------------------------------------------------------------------- Lightning collectives
    @contextmanager
    def gathered_parameters(self) -> Generator[None, None, None]:
        """Every parameter of the module whole for the duration of the block (stage 3 gathers; a collective every
        rank enters): the way to read parameters outside forward (see [Note: parameters outside forward] in
        core/flat/access.py). Before setup and after a run that gave full parameters back, a no-op."""
        with self._sharded.parameters_whole():
            yield

    @override
    def barrier(self, name: str | None = None) -> None:
        barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        return reduce_tensor(tensor, group, reduce_op)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for entry in STRATEGY_NAMES:
            if entry.name in strategy_registry:
                continue
            strategy_registry.register(
                entry.name,
                cls,
                description=entry.description,
                stage=int(entry.stage),
                start_method=entry.start_method,
                **entry.options,
            )


def _zero_grad_of(optimizer: Optimizer, set_to_none: bool = True) -> None:
    optimizer.zero_grad(set_to_none=set_to_none)
