"""``trainer.save_checkpoint`` when ZeroStrategy has no engine (after fit, or outside any fit): it still writes a
sharded checkpoint directory (see [Note: saving after fit] in zero_strategy/checkpoint/unsharded.py)."""

from __future__ import annotations

from typing import Any, Protocol

from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from zero_strategy.checkpoint.unsharded import NO_OPTIMIZER_STATE_KEY, copy_module_into_shards, save_module_weights
from zero_strategy.config import ZeroConfig
from zero_strategy.core.step.engine import ZeroEngine
from zero_strategy.lightning.checkpoint_io import ShardedCheckpointIO


class SavingStrategy(Protocol):
    """What a save without an engine reads from ZeroStrategy."""

    @property
    def lightning_module(self) -> LightningModule | None: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def start_method(self) -> str: ...

    @property
    def checkpoint_io(self) -> ShardedCheckpointIO: ...

    config: ZeroConfig


def save_without_engine(
    strategy: SavingStrategy, checkpoint: dict[str, Any], path: _PATH, fit_engine: ZeroEngine | None
) -> None:
    """The fit's released engine still holds the masters and optimizer state (plain launcher): save through it.
    Otherwise (spawn launcher's main process, or no fit) write the weights, saying why the optimizer state is
    absent."""
    module = strategy.lightning_module
    assert module is not None
    distributed = _distributed_is_initialized()
    # the fit's optimizers are still the Trainer's (a later test/validate keeps them; a new fit replaces them)
    same_optimizers = fit_engine is not None and list(map(id, fit_engine.optimizers)) == list(
        map(id, strategy.optimizers)
    )
    if fit_engine is not None and distributed and same_optimizers:
        copy_module_into_shards(fit_engine)
        strategy.checkpoint_io.save_sharded(fit_engine, checkpoint, path)
        return
    if any(param.is_meta for param in module.parameters()):
        raise RuntimeError(
            f"cannot save {path}: the module's parameters were left sharded by the last run (a model built sharded "
            "at stage 3, see full_params_after_fit) and the fit that trained them is not the Trainer's current "
            "one, so its optimizer state is gone. Save during fit (ModelCheckpoint), or call trainer.save_checkpoint "
            "right after trainer.fit."
        )
    if not distributed and strategy.global_rank != 0:
        return  # no process group to share the directory with: one writer (the spawn launcher's main process)
    extra: dict[str, Any] = {}
    if "optimizer_states" in checkpoint:  # optimizer state was asked for and does not exist here
        if strategy.start_method != "popen" and not distributed:
            why = "saved after a spawn-launched fit: the optimizer state lived in the worker processes"
        else:
            why = "saved outside fit, where this process holds no optimizer state"
        extra[NO_OPTIMIZER_STATE_KEY] = why
        rank_zero_warn(
            f"{path}: {why}. The checkpoint holds the weights only: zero-to-fp32 / consolidate work, resuming "
            "a fit from it does not. To keep the optimizer state, save during fit (ModelCheckpoint) or call "
            f"trainer.save_checkpoint after a fit with the plain name (e.g. 'zero{strategy.config.stage}', which "
            "runs fit in this process)."
        )
    state = {k: v for k, v in checkpoint.items() if k != "state_dict"}
    save_module_weights(module, strategy.config, path, state, strategy.checkpoint_io.save_info(extra))
