"""ZeroFabricStrategy: the Fabric adapter. It translates Fabric's calls into ZeroEngine calls on the same engine and
checkpoint code as the Trainer's ZeroStrategy; no collectives here: Fabric's own reduce/broadcast/barrier go to
adapter_plumbing/process_group.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import replace
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import TBroadcast, _Sharded
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from torch import Tensor, nn
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
from zero_strategy.config import CheckpointFormat, ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import MemoryReport, memory_report
from zero_strategy.core.init.construction_recorder import ConstructionRecorder
from zero_strategy.core.init.materialize import InitialValues
from zero_strategy.core.runtime.activation_checkpointing import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from zero_strategy.fabric.backward_sync import ZeroBackwardSyncControl
from zero_strategy.fabric.checkpoint import FabricCheckpoints
from zero_strategy.fabric.optimizer_class import forward_zero_grad
from zero_strategy.fabric.precision_selection import ZeroFabricPrecisionChoice
from zero_strategy.fabric.sharded_modules import ShardedModules
from zero_strategy.fabric.tensor_parallel import Parallelize, ParallelizeFn
from zero_strategy.initial_values import initial_values
from zero_strategy.names import STRATEGY_NAMES

STATE_DICT_TYPES = ("sharded", "full")


# ZeroFabricPrecisionChoice: the precision plugin it runs with (its properties narrow Strategy's, hence the ignore)
class ZeroFabricStrategy(ZeroFabricPrecisionChoice, ProcessPerDevice, ParallelStrategy, _Sharded):  # type: ignore[misc]
    """ZeRO sharded data parallelism (stage 1, 2 or 3) under Lightning Fabric.

    ``Fabric(strategy="zero3")`` after ``import zero_strategy``, or ``ZeroFabricStrategy(stage=3, **options)`` with
    the fields of :class:`zero_strategy.ZeroConfig` as keywords (or ``config=``). ``state_dict_type``: what
    ``fabric.save`` writes, "sharded" (a directory, one shard per rank) or "full" (one consolidated file).
    ``parallelize_fn`` (with ``tensor_parallel_size=K``): ModelParallelStrategy's tensor-parallel plan, applied in
    ``fabric.setup`` (see [Note: the parallelize_fn under Fabric] in fabric/tensor_parallel.py).
    """

    def __init__(
        self,
        stage: int | None = None,
        *,
        config: ZeroConfig | None = None,
        state_dict_type: str = "sharded",
        start_method: str = "popen",
        parallelize_fn: ParallelizeFn | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        **options: Any,
    ) -> None:
        resolved = strategy_options(stage, config, start_method, options)
        config = resolved.config
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r}: use 'sharded' (a directory, one shard per rank) "
                             "or 'full' (one consolidated file)")
        if config.checkpoint_format is not CheckpointFormat.zero:
            raise ValueError(
                f"checkpoint_format={config.checkpoint_format.value!r} is not available under Fabric yet: Fabric "
                "checkpoints are this package's sharded directory (zero-to-dcp converts one) or, with "
                "state_dict_type='full', one consolidated file."
            )
        if config.profile:
            raise ValueError(
                "profile=True is the Trainer's CommunicationProfiler callback, which Fabric has no place for: under "
                "Fabric read the bytes and seconds per collective from strategy.engine(model).comm_log instead."
            )
        if checkpoint_io is not None:
            raise TypeError("ZeroFabricStrategy writes its own checkpoints (sharded, or one file with "
                            "state_dict_type='full'); remove the CheckpointIO plugin.")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self.config = config
        self._checkpoint_policy = resolved.checkpoint_policy
        self._start_method = start_method
        self._parallelize = Parallelize(parallelize_fn, start_method)
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._recorder = ConstructionRecorder()
        # bound methods, not lambdas: the spawn launcher pickles the strategy into each rank
        self._modules = ShardedModules(self._build_engine, self._root_device)
        self._checkpoints = FabricCheckpoints(self._modules, state_dict_type == "full", self._is_global_zero)
        self._backward_sync_control = ZeroBackwardSyncControl(self.engine)
        self.take_over_precision_choice()  # built by the strategy registry inside a Fabric: see the method

    def _root_device(self) -> torch.device:
        return self.root_device

    def _is_global_zero(self) -> bool:
        return self.is_global_zero

    # ---------------------------------------------------- launch (where the ranks sit: ProcessPerDevice)
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)  # type: ignore[arg-type]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.assign_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, backend, self.config.process_group_timeout_s)
        self.build_device_mesh(self.root_device.type, self.world_size, None)  # with tensor_parallel_size > 1
        if self._device_mesh is None:  # a parallelize_fn with tensor_parallel_size=1 gets a (world, 1) mesh
            self._device_mesh = self._parallelize.mesh(self.root_device, self.world_size, self.config)

    # ---------------------------------------------------------------------------------- modules, optimizers
    def _build_engine(self, module: nn.Module, entry: ForwardEntry, optimizers: list[Optimizer],
                      values: InitialValues | None) -> ZeroEngine:
        # the mesh of tensor_parallel_size=1 is parallelize_fn's alone: ZeRO's layout stays its usual one
        mesh = self._device_mesh if self.config.tensor_parallel_size > 1 else None
        layout = rank_layout(self.config, self.world_size, self.num_processes, mesh)
        self.precision.attach(self._modules.engine_of, self.root_device.type)
        return ZeroEngine(module, optimizers, self.config, layout, entry, self.precision.settings.policy(),
                          initial_values=values)

    def _initial_values(self, module: nn.Module) -> AbstractContextManager[InitialValues]:
        """The recorded construction (``init_module(empty_init=True)``) and pretrained weights, when any:
        ``pretrained=`` fills the first module set up (a second one, a teacher say, brings its own values)."""
        self._recorder.materialize_if_nothing_to_shard(module)
        config = replace(self.config, pretrained=None) if self._modules.items else self.config
        return initial_values(module, self._recorder.take(), config, self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Shard ``module`` with its optimizers bound (one engine). Collective."""
        if self._modules.holds(module):  # see [Note: a module set up again] in sharded_modules.py
            entry = self._modules.setup_again(module, list(optimizers))
            for optimizer in optimizers:
                forward_zero_grad(optimizer)
            return entry, list(optimizers), scheduler
        module = self._parallelized(module, optimizers)
        self._checkpoint_activations(module)
        with self._initial_values(module) as values:
            entry = self._modules.setup(module, list(optimizers), values)
        for optimizer in optimizers:
            forward_zero_grad(optimizer)  # see [Note: zero_grad through Fabric's wrapper]
        return entry, list(optimizers), scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` now, without optimizers: its parameters are real (sharded at stage 3) for an optimizer
        built from them, set up next with ``setup_optimizers`` (see [Note: optimizers set up after their module]),
        or for evaluation and distillation. Collective."""
        if self._modules.holds(module):  # see [Note: a module set up again] in sharded_modules.py
            return self._modules.setup_again(module, [])
        module = self._parallelized(module, [])
        self._checkpoint_activations(module)
        with self._initial_values(module) as values:
            return self._modules.setup(module, [], values)

    def _parallelized(self, module: nn.Module, optimizers: list[Optimizer]) -> nn.Module:
        """The module ``parallelize_fn`` returns. One built on the meta device (``init_module(empty_init=True)``)
        gets the plan inside its recording, continued, so that each DTensor parameter's whole value is replayed
        (see [Note: tensor-parallel parameters built on the meta device] in core/init/distributed_origins.py)."""
        if not any(p.is_meta for p in module.parameters()):
            return self._parallelize.apply(module, self._device_mesh, optimizers)
        with self._recorder.recording_on(self.root_device):
            return self._parallelize.apply(module, self._device_mesh, optimizers)

    def _checkpoint_activations(self, module: nn.Module) -> None:
        """``activation_checkpointing``: wrap the selected submodules' forwards before the engine is built, as the
        Trainer's strategy does (teardown unwraps them)."""
        if self._checkpoint_policy is not None:
            apply_activation_checkpointing(module, self._checkpoint_policy, self.config.cpu_checkpointing)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Bind ``optimizer`` to the engine of the module it was built from. Collective."""
        self._modules.bind(optimizer)
        forward_zero_grad(optimizer)  # see [Note: zero_grad through Fabric's wrapper]
        return optimizer

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if self._modules.holds(module):
            return  # set up already: its engine placed it (see [Note: a module set up again])
        if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            return  # built on the meta device: the engine gives each unit its storage on root_device
        module.to(self.root_device)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: build on the meta device, recording the construction (see [Note:
        sharded construction] in core/init/materialize.py); otherwise Fabric's default (built whole on every rank)."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(self._recorder.recording_on(self.root_device))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return self._recorder.recording_on(self.root_device)

    def engine(self, module: nn.Module | None = None) -> ZeroEngine:
        """The engine of ``module`` (a set-up module, or the only one when None)."""
        if module is not None:
            return self._modules.find(getattr(module, "_forward_module", module)).engine
        if len(self._modules.items) != 1:
            raise ValueError(f"{len(self._modules.items)} modules are set up: name the module")
        return self._modules.items[0].engine

    @override
    def teardown(self) -> None:
        for item in self._modules.items:
            remove_activation_checkpointing(item.module)
        self._modules.release_all()
        super().teardown()
        if self._start_method != "popen":
            destroy_after_spawned_run()

    # ------------------------------------------------------------------------------------- the step's parts
    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Global-norm clipping over every rank's slices (the base class would clip each rank's own slice)."""
        engine = self._modules.engine_of(optimizer)
        if self.precision.unscale_and_check(optimizer):
            return engine.grad_norm(optimizer, float(norm_type))  # fp16 overflow: the step will be skipped
        norm = engine.clip_grad_norm_(optimizer, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({norm.item()}),"
                               " so it cannot be clipped; pass error_if_nonfinite=False to clip anyway.")
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_and_check(optimizer)
        self._modules.engine_of(optimizer).clip_grad_value_(optimizer, float(clip_val))

    def memory_report(self, module: nn.Module | None = None) -> MemoryReport:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return memory_report(self.engine(module))

    def communication_report(self, module: nn.Module | None = None) -> dict[str, int]:
        """Bytes sent per collective kind since the module was sharded."""
        return self.engine(module).comm_log.snapshot()

    @contextmanager
    def gathered_parameters(self, module: nn.Module | None = None) -> Iterator[None]:
        """Every parameter of the module whole for the block (stage 3 gathers: every rank enters it)."""
        with self.engine(module).gathered_parameters():
            yield

    # -------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Every rank writes its shard of the directory rank 0 names (see [Note: what a Fabric checkpoint holds])."""
        if storage_options is not None:
            raise TypeError("ZeroFabricStrategy.save_checkpoint does not take storage_options")
        self._checkpoints.save(self.broadcast(path), state, self.precision, filter)

    @override
    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(self.broadcast(path), state, self.precision, strict, weights_only)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer state keyed by parameter name, on rank 0 (``{}`` on the others). Collective."""
        from zero_strategy.checkpoint.strategy_io.full_state import full_optimizer_state

        return full_optimizer_state(self._modules.engine_of(optimizer), optimizer)

    # ------------------------------------------------------------------------------ Fabric's collectives
    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None,
                   reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        return reduce_tensor(tensor, group, reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for entry in STRATEGY_NAMES:
            if entry.name in strategy_registry:
                continue
            strategy_registry.register(entry.name, cls, description=entry.description, stage=int(entry.stage),
                                       start_method=entry.start_method, **entry.options)
