"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` under ZeRO, on the same checkpoint code as the Trainer.

[Note: what a Fabric checkpoint holds]
Fabric's state is a dict of modules, optimizers, stateful objects (``state_dict``/``load_state_dict``: LR
schedulers, stateful data loaders) and plain values. By default ``fabric.save(path, state)`` writes this package's
sharded directory (checkpoint/base/format.py): the set-up module's master slices and, when the state holds its
optimizers, their state, one shard per rank, nothing gathered; the other entries, the keys that name the module
and the optimizers, and the loss scaler go into its trainer-state file. ``fabric.load(path, state, strict)`` reads
it at any world size and stage (by parameter name and element range) and restores each entry in place;
``strict=False`` skips entries the checkpoint lacks and loads the parameters that match. ``state_dict_type="full"``
(or a ``filter`` on a module or optimizer) writes one consolidated file instead (see [Note: the consolidated
Fabric file] in checkpoint/strategy_io/full_state.py), which loads back the same way. ``fabric.load_raw(path, model)``
reads a plain state dict (a torch file, safetensors, a Hugging Face or zero-to-fp32 output, a sharded directory)
memory-mapped, each rank reading only the element ranges it keeps. One set-up module per checkpoint.

[Note: the consolidated file holds the user's keys]
The sharded directory records, in its trainer-state file under ``zero_strategy.fabric``, which keys are the module
and the optimizers and the fp16 loss scaler's state; ``fabric.load`` reads that entry and never returns it. The
consolidated file (``state_dict_type="full"``) is a plain ``torch.save`` that anyone loads, so like DDP's and FSDP's
it holds the user's keys only: the keys name themselves in it, and the loss scaler is saved as Fabric saves a
GradScaler, when the state holds it (``state["precision"] = fabric.strategy.precision``, a stateful object).
Loading a file written with the entry (before this) still reads and drops it.

[Note: Fabric checkpoints with tensor parallelism]
With ``tensor_parallel_size=K > 1`` ``fabric.save`` writes what the Trainer writes: one sharded checkpoint per TP
coordinate and ``tensor_parallel.json`` switched last (see [Note: tensor-parallel checkpoint layout] in
checkpoint/sharded/tensor_parallel.py), through the Trainer's writer choice (``save_checkpoint_as``), so a save is
atomic across the whole world and ``zero-to-fp32`` reads it as whole tensors. ``fabric.load`` opens what this
rank's TP coordinate reads through the Trainer's ``open_for_run`` (its own part at the same TP size, at any DP size;
whole tensors cut into this run's blocks at another TP size, or without tensor parallelism), then loads as for any
sharded directory. Each rank's place comes from its engine (the TP group's size and its rank in it), so the adapter
adds no collective. Not done for a module with DTensor parameters (a named TensorParallelCheckpointError): the
consolidated file (``state_dict_type="full"``, a ``filter``), loading one, and ``load_raw``; they would read or
write each rank's local block as if it were the whole tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from zero_strategy.checkpoint.base.format import BUFFERS_KEY, MANIFEST_NAME, PARAM_GROUPS_KEY
from zero_strategy.checkpoint.sharded.load import check_compatible, load_optimizer_state, load_weights
from zero_strategy.checkpoint.sharded.tensor_parallel import is_tensor_parallel_directory
from zero_strategy.checkpoint.sharded.tensor_parallel_blocks import RunCheckpoint, open_for_run
from zero_strategy.checkpoint.strategy_io.full_state import (
    full_optimizer_state,
    full_weights,
    load_full_optimizer_state,
)
from zero_strategy.checkpoint.strategy_io.save_info import save_info
from zero_strategy.checkpoint.strategy_io.whole_file import load_raw_module, read_whole_file, write_whole_file
from zero_strategy.checkpoint.strategy_io.writer_choice import save_checkpoint_as
from zero_strategy.config import CheckpointFormat
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.plan.tensor_parallel import is_distributed
from zero_strategy.fabric.precision import ZeroFabricPrecision
from zero_strategy.fabric.sharded_modules import ShardedModule, ShardedModules
from zero_strategy.fabric.tensor_parallel import TensorParallelCheckpointError

FABRIC_KEY = "zero_strategy.fabric"
"""The entry where a Fabric checkpoint records which keys are the module and optimizers, and the loss scaler."""


@dataclass(slots=True)
class SortedState:
    """A Fabric state dict, sorted: the set-up module, its optimizers (key → index in its engine), the rest."""

    module_key: str | None = None
    item: ShardedModule | None = None
    optimizer_keys: dict[str, int] = field(default_factory=dict)
    other: dict[str, Any] = field(default_factory=dict)

    @property
    def engine(self) -> ZeroEngine:
        if self.item is None:
            raise ValueError("the state holds no module set up by the ZeRO strategy; add it (state['model'] = model)")
        return self.item.engine


def sort_state(state: dict[str, Any], modules: ShardedModules) -> SortedState:
    """Which entries of ``state`` ZeRO holds (the set-up module, its optimizers) and which are Fabric's."""
    sorted_state = SortedState()
    for key, obj in state.items():
        if isinstance(obj, nn.Module) and modules.holds(obj):
            if sorted_state.item is not None:
                raise ValueError(f"the state holds two modules set up by the ZeRO strategy ({sorted_state.module_key!r}"
                                 f" and {key!r}); save each in a checkpoint of its own.")
            sorted_state.module_key, sorted_state.item = key, modules.find(obj)
        elif not isinstance(obj, Optimizer):
            sorted_state.other[key] = obj  # a module not set up here (an EMA copy, say) is a stateful object
    for key, obj in state.items():
        if isinstance(obj, Optimizer):
            engine = modules.engine_of(obj)
            if sorted_state.item is None or engine is not sorted_state.item.engine:
                raise ValueError(f"optimizer {key!r} steps a module that is not in the state: add that module.")
            sorted_state.optimizer_keys[key] = engine.optimizer_index(obj)
    return sorted_state


class FabricCheckpoints:
    """Saves and loads Fabric states of one strategy (see [Note: what a Fabric checkpoint holds])."""

    def __init__(self, modules: ShardedModules, full: bool, is_leader: Callable[[], bool]) -> None:
        self.modules = modules
        self.full = full  # state_dict_type="full": one consolidated file
        self.is_leader = is_leader  # global rank 0: the writer of a consolidated file

    # ------------------------------------------------------------------------------------------------ save
    def save(self, path: str | os.PathLike, state: dict[str, Any], precision: ZeroFabricPrecision,
             filter: dict[str, Any] | None) -> None:
        """Collective: every rank calls it with the same state keys."""
        sorted_state = sort_state(state, self.modules)
        filter = filter or {}
        held = {sorted_state.module_key, *sorted_state.optimizer_keys}
        plain: dict[str, Any] = {}
        for key, obj in sorted_state.other.items():
            _apply_filter(key, filter, obj.state_dict() if isinstance(obj, _Stateful) else obj, plain)
        if self.full or held & set(filter) or sorted_state.item is None:  # a filter selects by name: one file
            if sorted_state.item is not None:
                _refuse_tensor_parallel(sorted_state.engine, "fabric.save as one consolidated file "
                                        '(state_dict_type="full" or a filter on the module or an optimizer)')
            self._save_full(Path(path), sorted_state, plain, filter)
            return
        engine = sorted_state.engine
        trainer_state = {**plain, FABRIC_KEY: _record(sorted_state, precision)}
        if sorted_state.optimizer_keys:
            trainer_state["optimizer_states"] = [{} for _ in engine.optimizers]  # their state goes to the shards
        # the Trainer's choice: one sharded directory, or with tensor parallelism one per TP coordinate (see [Note:
        # Fabric checkpoints with tensor parallelism]); ZeroFabricStrategy accepts checkpoint_format="zero" only
        save_checkpoint_as(CheckpointFormat.zero, engine, path, trainer_state, save_info(precision.precision))

    def _save_full(self, path: Path, sorted_state: SortedState, plain: dict[str, Any],
                   filter: dict[str, Any]) -> None:
        """The user's keys only, as DDP's and FSDP's full file: see [Note: the consolidated file holds the user's
        keys]."""
        content: dict[str, Any] = dict(plain)
        if sorted_state.item is not None and sorted_state.module_key is not None:
            engine = sorted_state.engine
            content[sorted_state.module_key] = full_weights(engine, filter.get(sorted_state.module_key))
            for key, index in sorted_state.optimizer_keys.items():
                _apply_filter(key, filter, full_optimizer_state(engine, engine.optimizers[index]), content)
        if self.is_leader():  # the others hold no values (see [Note: the consolidated Fabric file])
            write_whole_file(path, content)

    # ------------------------------------------------------------------------------------------------ load
    def load(self, path: str | os.PathLike, state: Any, precision: ZeroFabricPrecision, strict: bool,
             weights_only: bool | None) -> dict[str, Any]:
        """Restore ``state`` in place (a dict, or a module / optimizer for ``load_raw``); returns what the checkpoint
        holds beyond it. Collective."""
        target = Path(path)
        if isinstance(state, nn.Module):
            engine = self.modules.find(state).engine
            _refuse_tensor_parallel(engine, "fabric.load_raw")
            load_raw_module(engine, target, strict)
            return {}
        if isinstance(state, Optimizer):
            engine = self.modules.engine_of(state)
            _refuse_tensor_parallel(engine, "fabric.load_raw of an optimizer")
            content = read_whole_file(target, weights_only)
            load_full_optimizer_state(engine, state, content)
            return {}
        if target.is_dir() and ((target / MANIFEST_NAME).is_file() or is_tensor_parallel_directory(target)):
            return self._load_sharded(target, state or {}, precision, strict, weights_only)
        content = read_whole_file(target, weights_only)
        if not state:
            return {key: value for key, value in content.items() if key != FABRIC_KEY}
        return self._load_full(content, state, precision, strict)

    def _load_sharded(self, path: Path, state: dict[str, Any], precision: ZeroFabricPrecision, strict: bool,
                      weights_only: bool | None) -> dict[str, Any]:
        sorted_state = sort_state(state, self.modules) if state else SortedState()
        opened = _open_for(path, sorted_state)
        try:
            saved = opened.trainer_state(weights_only)
            record = saved.pop(FABRIC_KEY, {})
            param_groups, buffers = saved.pop(PARAM_GROUPS_KEY, []), saved.pop(BUFFERS_KEY, {})
            saved.pop("optimizer_states", None)
            if not state:
                return saved
            keys = set(saved) | {record.get("module")} | set(record.get("optimizers", {}))
            _validate_keys_for_strict_loading(state.keys(), keys, strict)
            engine = sorted_state.engine
            with_optimizer = bool(sorted_state.optimizer_keys) and opened.manifest.has_optimizer_state
            # the TP views read as a ShardedCheckpoint does; check_compatible is typed on it (as in lightning/)
            check_compatible(engine, opened, strict=strict, with_optimizer=with_optimizer)  # type: ignore[arg-type]
            load_weights(engine, opened)
            engine.module.load_state_dict(buffers, strict=False)
            if with_optimizer:
                load_optimizer_state(engine, opened, param_groups)
        finally:
            opened.close()
        precision.load_state_dict(record.get("precision", {}))
        return _restore_others(state, set(sorted_state.other), saved)

    def _load_full(self, content: dict[str, Any], state: dict[str, Any], precision: ZeroFabricPrecision,
                   strict: bool) -> dict[str, Any]:
        content = dict(content)
        record = content.pop(FABRIC_KEY, {})  # files written before the full file held the user's keys only
        _validate_keys_for_strict_loading(state.keys(), content.keys(), strict)
        sorted_state = sort_state(state, self.modules)
        if sorted_state.item is not None:
            _refuse_tensor_parallel(sorted_state.engine, "fabric.load of a consolidated file")
        if sorted_state.module_key in content:
            sorted_state.engine.module.load_state_dict(content.pop(sorted_state.module_key), strict=strict)
        for key, index in sorted_state.optimizer_keys.items():
            if key in content:
                engine = sorted_state.engine
                load_full_optimizer_state(engine, engine.optimizers[index], content.pop(key))
        precision.load_state_dict(record.get("precision", {}))
        return _restore_others(state, set(sorted_state.other), content)


def _open_for(path: Path, sorted_state: SortedState) -> RunCheckpoint:
    """What this rank reads of the checkpoint ``path`` (see [Note: Fabric checkpoints with tensor parallelism]):
    placed by the state's engine; without a module in the state, any part (they hold the same trainer state)."""
    if sorted_state.item is None:
        return open_for_run(path, 1, 0, None)
    engine = sorted_state.engine
    tensor = engine.comms.tensor
    size, coordinate = (1, 0) if tensor is None else (tensor.size, tensor.rank)
    return open_for_run(path, size, coordinate, engine.module)


def _refuse_tensor_parallel(engine: ZeroEngine, what: str) -> None:
    """A named error where a Fabric checkpoint would take a rank's local block for the whole tensor (see [Note:
    Fabric checkpoints with tensor parallelism])."""
    if any(is_distributed(param) for param in engine.module.parameters()):
        raise TensorParallelCheckpointError(
            f"ZeRO: {what} of a tensor-parallel module (DTensor parameters from parallelize_fn) is not supported "
            "under Fabric yet. Save with fabric.save(path, state) as the sharded directory (the default "
            'state_dict_type="sharded") and load it with fabric.load(path, state); zero-to-fp32 turns that '
            "directory into one file of the whole model; whole weights load into the module before "
            "fabric.setup_module."
        )


def _record(sorted_state: SortedState, precision: ZeroFabricPrecision) -> dict[str, Any]:
    return {"module": sorted_state.module_key, "optimizers": dict(sorted_state.optimizer_keys),
            "precision": precision.state_dict()}


def _restore_others(state: dict[str, Any], others: set[str], saved: dict[str, Any]) -> dict[str, Any]:
    """Fabric's rule for the entries ``others`` of ``state``: stateful objects load in place, plain values replace
    the state's; the checkpoint's entries left over are returned."""
    remainder = dict(saved)
    for key in others:
        if key not in remainder:
            continue
        if isinstance(state[key], _Stateful):
            state[key].load_state_dict(remainder.pop(key))
        else:
            state[key] = remainder.pop(key)
    return remainder
