"""Lightning's checkpoint hooks of ZeroStrategy: saving through the engine (or the module, see [Note: saving after
fit] in sharded_model.py), and restoring before setup.

[Note: restoring before setup]
Lightning restores a checkpoint's module and callbacks before ``strategy.setup`` unless the strategy asks for it
after (``restore_checkpoint_after_setup``); only then do ``on_load_checkpoint``, ``Callback.on_load_checkpoint`` and
``Callback.load_state_dict`` run before ``configure_optimizers`` and ``on_fit_start``, as under DDP (so
``ModelCheckpoint.best_model_path`` is known in ``on_fit_start``). The weights, though, go into the master slices,
which exist only once setup has sharded the model. So the strategy restores before setup as DDP does, and keeps the
weights' part for later: ``load_checkpoint`` opens and validates the files and gives Lightning the trainer state with
the state dict's keys (see [Note: the state dict in Lightning's hooks]); ``load_model_state_dict`` takes what the
hooks left of them; setup, once the engine exists, checks the checkpoint against the model (nothing changes if it
does not fit) and loads the weights, buffers and random state; the optimizer state follows in Lightning's
``restore_training_state``, after setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from zero_strategy.checkpoint.base.renamed import RenamedCheckpoint
from zero_strategy.checkpoint.base.source import ReadableCheckpoint
from zero_strategy.checkpoint.sharded.load import load_optimizer_state, load_weights, restore_rank_rng
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.lightning.checkpoint_io import ShardedCheckpointIO
from zero_strategy.lightning.hook_state_dict import (
    load_placeholders,
    names_after_load_hooks,
    renames_after_save_hooks,
    save_placeholders,
)
from zero_strategy.lightning.sharded_model import ModelState, ShardedModel


@dataclass(slots=True)
class PendingLoad:
    """What ``load_model_state_dict`` was asked to load, waiting for the engine (see [Note: restoring before
    setup])."""

    view: ReadableCheckpoint  # the opened checkpoint, under the names the load hooks asked for
    buffers: dict[str, Any]
    strict: bool


class ShardedCheckpointHooks(ParallelStrategy):
    """The checkpoint part of ZeroStrategy's Lightning API, a base class of it (see the module docstring)."""

    _sharded: ShardedModel  # the engine across runs (ZeroStrategy.__init__)
    config: ZeroConfig
    _start_method: str
    _pending_load: PendingLoad | None = None
    _loaded: ReadableCheckpoint | None = None  # the view the weights came from; the optimizer state follows it
    _load_wants_optimizer = False
    _save_given: dict[str, Any] | None = None  # the placeholders handed to on_save_checkpoint
    _load_given: dict[str, Any] | None = None  # the placeholders handed to on_load_checkpoint

    @override
    def __getstate__(self) -> dict:
        """A copy holds no engine and no view of an opened checkpoint (its file handles cannot travel): see [Note: a
        copy of the strategy holds no engine] in sharded_model.py."""
        state = super().__getstate__()
        state.update(_pending_load=None, _loaded=None)
        return state

    @property
    def engine(self) -> ZeroEngine:
        """The engine of the current run (see [Note: saving after fit] in sharded_model.py)."""
        return self._sharded.active

    @property  # type: ignore[override]
    def checkpoint_io(self) -> ShardedCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        assert isinstance(self._checkpoint_io, ShardedCheckpointIO)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None and not isinstance(io, ShardedCheckpointIO):
            raise TypeError(
                f"ZeroStrategy saves sharded checkpoints and needs ShardedCheckpointIO, got {type(io).__name__}. "
                "Remove the CheckpointIO plugin; use zero-to-fp32 to get a single-file checkpoint."
            )
        if io is not None and hasattr(self, "config"):  # Lightning's connector may hand a new one after __init__
            io.checkpoint_format = self.config.checkpoint_format
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return False  # see [Note: restoring before setup]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every key with a placeholder value: each rank writes its own slices from the shards, nothing is gathered
        (see [Note: the state dict in Lightning's hooks])."""
        assert self.lightning_module is not None
        self._save_given = save_placeholders(self.lightning_module)
        return dict(self._save_given)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Empty: each rank writes its own optimizer-state slices into its shard."""
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank; every rank writes its shard into the directory rank 0 names.
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options")
        path = self.broadcast(filepath)
        given, self._save_given = self._save_given, None
        renames = renames_after_save_hooks(checkpoint.get("state_dict", {}), given) if given is not None else {}
        source = self._sharded.save_source(self.optimizers)  # see [Note: saving after fit]
        if source is not None:
            engine, with_optimizer = source
            self.checkpoint_io.save_sharded(engine, checkpoint, path, with_optimizer, renames)
        else:
            self._save_from_module(checkpoint, path, renames)

    def _save_from_module(self, checkpoint: dict[str, Any], path: _PATH, renames: dict[str, str | None]) -> None:
        """No engine in this process (see [Note: saving after fit]): the module's own weights, one writer."""
        module = self.lightning_module
        assert module is not None
        self._sharded.check_holds_weights(module, path, self.checkpoint_io.handed_back)
        if _distributed_is_initialized() and self.global_rank != 0:
            return  # one writer (the Trainer's barrier follows)
        spawned_fit = self._start_method != "popen" and not _distributed_is_initialized()
        self.checkpoint_io.save_from_module(module, self.config, checkpoint, path, spawned_fit, renames)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Open and validate the files; Lightning's trainer state, the state dict's keys (see [Note: restoring
        before setup]). Before setup: nothing of the model changes here."""
        path = self.broadcast(checkpoint_path)
        module = self.lightning_module
        assert module is not None
        self.checkpoint_io.module = module
        self.checkpoint_io.tensor_parallel = self._tensor_parallel_place()
        state = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        opened = self.checkpoint_io.opened
        if opened is None:  # the spawn launcher's plain hand-over of rank 0's weights
            return state
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        absent = self.checkpoint_io.optimizer_state_absent()  # said why: say it again
        self._load_wants_optimizer = fitting and ("optimizer_states" in state or absent)
        self._load_given = load_placeholders(opened, self.checkpoint_io.buffers)
        state["state_dict"] = dict(self._load_given)
        return state

    def _tensor_parallel_place(self) -> tuple[int, int]:
        """(tensor_parallel_size, this rank's TP coordinate); (1, 0) without tensor parallelism."""
        mesh = getattr(self, "_device_mesh", None)  # ProcessPerDevice builds it in setup_environment
        if mesh is None:
            return 1, 0
        return self.config.tensor_parallel_size, mesh.get_local_rank("tensor_parallel")

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Take what the load hooks left of the state dict; load it once the engine exists (now, if it does)."""
        opened = self.checkpoint_io.opened
        assert opened is not None and self._load_given is not None, "load_checkpoint() must run first"
        edited: dict[str, Any] = checkpoint.get("state_dict", {})
        names = names_after_load_hooks(edited, self._load_given)
        view: ReadableCheckpoint = opened
        if names is not None:
            view = RenamedCheckpoint(opened, {new: old for new, old in names.items() if old in opened.params})
        buffers = {key: value for key, value in edited.items() if not (isinstance(value, Tensor) and value.is_meta)}
        self._pending_load = PendingLoad(view, buffers, strict)
        if self._sharded.state is ModelState.SHARDED:
            self.apply_pending_load()

    def apply_pending_load(self) -> None:
        """Once the engine exists: check, then load weights, buffers and this rank's random state."""
        pending, self._pending_load = self._pending_load, None
        if pending is None:
            return
        with_optimizer = self._load_wants_optimizer and bool(self.optimizers)
        self.checkpoint_io.check(pending.view, strict=pending.strict, with_optimizer=with_optimizer)
        load_weights(self.engine, pending.view)  # type: ignore[arg-type]
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(pending.buffers, strict=False)
        restore_rank_rng(self.engine, pending.view)
        self._loaded = pending.view

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        assert self._loaded is not None, "the weights load first (setup)"
        load_optimizer_state(self.engine, self._loaded, self.checkpoint_io.param_groups)  # type: ignore[arg-type]
        self._loaded = None
        self.checkpoint_io.close()

