"""ShardedCheckpointIO: Lightning's checkpoint hooks mapped onto sharded checkpoint directories.

Every rank calls ``save_checkpoint`` (ZeroStrategy makes sure of that); each writes its own shard, in the format
``checkpoint_format`` names (our sharded directory, or a ``torch.distributed.checkpoint`` directory). Loading
reads either, and a DeepSpeed ZeRO checkpoint directory, whatever the setting, and is split in two so that
Lightning's restore order works: ``load_checkpoint`` validates every file and the model's compatibility before
anything changes and returns Lightning's trainer state; the strategy then loads weights and optimizer state from
:attr:`opened` at the points where Lightning restores the model and the optimizers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch import __version__ as lightning_version
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from zero_strategy.checkpoint.base.format import (
    BUFFERS_KEY,
    MANIFEST_NAME,
    NO_OPTIMIZER_STATE_KEY,
    PARAM_GROUPS_KEY,
    CheckpointError,
)
from zero_strategy.checkpoint.base.renamed import RenamedCheckpoint
from zero_strategy.checkpoint.base.source import ReadableCheckpoint
from zero_strategy.checkpoint.dcp.paths import is_dcp_directory
from zero_strategy.checkpoint.deepspeed.layout import is_deepspeed_directory
from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zero_strategy.checkpoint.sharded.load import check_compatible
from zero_strategy.checkpoint.sharded.module_snapshot import ModuleSnapshot
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.save import SaveInfo
from zero_strategy.checkpoint.sharded.tensor_parallel import is_tensor_parallel_directory
from zero_strategy.checkpoint.sharded.tensor_parallel_blocks import LocalBlocksView, RunCheckpoint, open_for_run
from zero_strategy.checkpoint.sharded.tensor_parallel_view import TensorParallelView
from zero_strategy.checkpoint.strategy_io.save_info import save_info
from zero_strategy.checkpoint.strategy_io.writer_choice import save_checkpoint_as
from zero_strategy.config import CheckpointFormat, ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.lightning.deepspeed_loops import loops_at_global_step

if TYPE_CHECKING:
    from zero_strategy.checkpoint.dcp.reader import DcpCheckpoint


class ShardedCheckpointIO(CheckpointIO):
    """Writes and reads zero_strategy sharded checkpoint directories (see zero_strategy/checkpoint/base/format.py)."""

    def __init__(self) -> None:
        self._engine: ZeroEngine | None = None
        self._precision = "32-true"
        self.opened: RunCheckpoint | DcpCheckpoint | DeepSpeedCheckpoint | None = None
        self.param_groups: list[list[dict]] = []
        self.buffers: dict[str, Any] = {}
        self.checkpoint_format = CheckpointFormat.zero  # ZeroStrategy sets its config's
        # what the spawn launcher loaded into the main process's module after fit: key -> whether it held values
        self.handed_back: dict[str, bool] | None = None
        self.module: nn.Module | None = None  # the module a checkpoint is opened for (ZeroStrategy sets it)
        # this run's (tensor_parallel_size, this rank's TP coordinate): which part of a tensor-parallel checkpoint
        # it resumes from (see [Note: tensor-parallel checkpoint layout]); ZeroStrategy sets it before opening one
        self.tensor_parallel: tuple[int, int] = (1, 0)

    def __getstate__(self) -> dict[str, Any]:
        """A copy holds no engine and no opened checkpoint (its file handles cannot travel): see [Note: a copy of the
        strategy holds no engine] in sharded_model.py."""
        return {**vars(self), "_engine": None, "opened": None}

    def attach(self, engine: ZeroEngine | None, precision: str) -> None:
        self._engine = engine
        self._precision = precision
        if engine is not None:
            self.module = engine.module

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ShardedCheckpointIO is used before ZeroStrategy sharded the model.")
        return self._engine

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ShardedCheckpointIO.save_checkpoint does not take storage_options")
        if self._engine is None:
            # Not sharding (after teardown): Lightning's spawn launcher hands the final plain state_dict from
            # rank 0 to the main process through this plugin. Write it as TorchCheckpointIO would. (A user's
            # trainer.save_checkpoint after fit does not come here: ZeroStrategy writes a sharded directory.)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, path)
            return
        self.save_sharded(self.engine, checkpoint, path)

    def save_sharded(
        self, engine: ZeroEngine, checkpoint: dict[str, Any], path: _PATH, with_optimizer: bool = True,
        renames: dict[str, str | None] | None = None,
    ) -> None:
        """Write ``checkpoint`` (Lightning's dict) as a checkpoint directory in :attr:`checkpoint_format` from
        ``engine``'s shards. Collective. ``with_optimizer=False``: the engine does not hold the Trainer's optimizer
        state (a save after a validate/test without a fit in this process); the manifest says so."""
        # The module's parameters and the optimizer states live in the shards; keep Lightning's remaining state.
        trainer_state = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        extra: dict[str, Any] = {}
        if "optimizer_states" in trainer_state:
            if with_optimizer:
                trainer_state["optimizer_states"] = [{} for _ in trainer_state["optimizer_states"]]
            else:
                del trainer_state["optimizer_states"]
                extra[NO_OPTIMIZER_STATE_KEY] = ("saved after a run without a fit in this process (validate, test "
                                                 "or predict), where it holds no optimizer state")
        info = self.save_info(extra, renames)
        save_checkpoint_as(self.checkpoint_format, engine, path, trainer_state, info)

    def save_from_module(
        self, module: nn.Module, config: ZeroConfig, checkpoint: dict[str, Any], path: _PATH, spawned_fit: bool,
        renames: dict[str, str | None] | None = None,
    ) -> None:
        """A checkpoint of one rank from the module's own weights, no optimizer state (see [Note: saving after fit]
        in sharded_model.py). One writer: the caller makes sure only one rank calls it."""
        why = ("saved after a spawn-launched fit: the optimizer state lived in the worker processes" if spawned_fit
               else "saved outside fit, where this process holds no optimizer state")
        if "optimizer_states" in checkpoint:
            rank_zero_warn(
                f"{path}: {why}. The checkpoint holds the weights only: zero-to-fp32 / consolidate work, resuming a "
                "fit from it does not. To keep the optimizer state, save during fit (ModelCheckpoint) or call "
                f"trainer.save_checkpoint after a fit with the plain name (e.g. 'zero{config.stage}', which runs "
                "fit in this process)."
            )
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        snapshot = ModuleSnapshot(module, config)
        info = self.save_info({NO_OPTIMIZER_STATE_KEY: why}, renames)
        save_checkpoint_as(self.checkpoint_format, snapshot, path, state, info)

    def save_info(
        self, extra: dict[str, Any] | None = None, renames: dict[str, str | None] | None = None
    ) -> SaveInfo:
        return save_info(self._precision, extra, renames)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Validate the checkpoint against the sharded model and return Lightning's state (no model change)."""
        if self._engine is None and Path(path).is_file():  # the spawn launcher's plain hand-over (see above)
            state = dict(torch.load(path, map_location=map_location or "cpu", weights_only=True))
            # a parameter the worker left sharded arrives on the meta device: nothing to load from it
            self.handed_back = {k: not (isinstance(v, torch.Tensor) and v.is_meta) for k, v in state.items()}
            return {k: v for k, v in state.items() if self.handed_back[k]}
        self.close()
        ours = (Path(path) / MANIFEST_NAME).is_file() or is_tensor_parallel_directory(Path(path))
        if is_dcp_directory(Path(path)) and not ours:
            state = self._open_dcp(path, weights_only)
        elif is_deepspeed_directory(Path(path)) and not ours:
            state = self._open_deepspeed(path)
        else:
            opened = open_for_run(Path(path), *self.tensor_parallel, self.module)
            try:
                state = opened.trainer_state(weights_only)
            except Exception:
                opened.close()
                raise
            self.opened = opened
            self.param_groups = state.pop(PARAM_GROUPS_KEY, [])
            self.buffers = state.pop(BUFFERS_KEY, {})
        state["state_dict"] = {}
        return state

    def _open_dcp(self, path: _PATH, weights_only: bool | None) -> dict[str, Any]:
        """A DCP directory (ours, or Lightning's FSDP/ModelParallel sharded checkpoint with its ``meta.pt``)."""
        from zero_strategy.checkpoint.dcp.blocks import DcpBlocks
        from zero_strategy.checkpoint.dcp.load import dcp_buffers

        assert self.module is not None, "ZeroStrategy names the module before it opens a checkpoint"
        opened = DcpBlocks(path, self.module, self.tensor_parallel)  # this rank's tensor-parallel blocks
        if not opened.has_trainer_state():
            raise CheckpointError(
                f"{path} is a DCP checkpoint without Lightning's trainer state (no zero_strategy.trainer_state item, "
                f"no meta.pt), so a fit cannot resume from it. To start a fit from its weights, pass "
                f"pretrained={str(path)!r} to ZeroStrategy and fit without ckpt_path."
            )
        state = opened.trainer_state(weights_only)
        if opened.has_optimizer_state and "optimizer_states" not in state:  # Lightning's meta.pt leaves it out
            state["optimizer_states"] = [{}]  # each rank reads its own slices: nothing in these
        self.opened = opened
        self.param_groups = []  # read in check(): matching groups needs the engine's
        self.buffers = dcp_buffers(self.module, opened)
        return state

    def _open_deepspeed(self, path: _PATH) -> dict[str, Any]:
        """A DeepSpeed ZeRO checkpoint (its plain engine layout or Lightning's DeepSpeedStrategy directory)."""
        from zero_strategy.checkpoint.deepspeed.load import (
            deepspeed_buffers,
            deepspeed_trainer_state,
            loss_scaler_state,
        )
        from zero_strategy.checkpoint.deepspeed.universal import open_deepspeed
        from zero_strategy.lightning.precision import ZeroPrecision

        assert self.module is not None, "ZeroStrategy names the module before it opens a checkpoint"
        opened = open_deepspeed(path)
        state = deepspeed_trainer_state(opened)
        trainer = getattr(self.module, "_trainer", None)
        if "loops" not in state and isinstance(trainer, Trainer):  # a plain engine's: no Lightning state in it
            state["loops"] = loops_at_global_step(trainer, state["global_step"])
            state.update({"pytorch-lightning_version": lightning_version, "epoch": 0})
        scaler = loss_scaler_state(opened)
        if scaler is not None:  # fp16: where ZeroPrecision.load_state_dict finds it
            state[ZeroPrecision.__qualname__] = {"loss_scaler": scaler}
        self.opened = opened
        self.param_groups = []  # read in check(): matching groups needs the engine's
        self.buffers = deepspeed_buffers(opened)
        return state

    def optimizer_state_absent(self) -> bool:
        """Whether the opened checkpoint records that it was saved without optimizer state (and why)."""
        if isinstance(self.opened, ShardedCheckpoint | TensorParallelView | LocalBlocksView):
            return NO_OPTIMIZER_STATE_KEY in self.opened.manifest.extra
        if self.opened is not None:
            info = self.opened.info or {}
            return NO_OPTIMIZER_STATE_KEY in info.get("extra", {})
        return False

    def check(self, view: ReadableCheckpoint, strict: bool, with_optimizer: bool) -> None:
        """Raise when ``view`` (the opened checkpoint, or it under the names the load hooks asked for) does not fit
        the sharded model; nothing has changed yet."""
        assert self.opened is not None
        if isinstance(self.opened, ShardedCheckpoint | TensorParallelView | LocalBlocksView):
            check_compatible(self.engine, view, strict=strict, with_optimizer=with_optimizer)  # type: ignore[arg-type]
            return
        if isinstance(self.opened, DeepSpeedCheckpoint):
            from zero_strategy.checkpoint.deepspeed.load import check_deepspeed_compatible
            from zero_strategy.checkpoint.deepspeed.load import param_groups_for as deepspeed_groups

            renamed = view.sources if isinstance(view, RenamedCheckpoint) else None
            check_deepspeed_compatible(self.engine, self.opened, strict, with_optimizer, renamed)
            if with_optimizer:
                self.param_groups = deepspeed_groups(self.engine, self.opened, renamed)
            return
        from zero_strategy.checkpoint.dcp.load import check_dcp_compatible, param_groups_for

        check_dcp_compatible(self.engine, self.opened, strict=strict, with_optimizer=with_optimizer)
        if with_optimizer:
            self.param_groups = param_groups_for(self.engine, self.opened)

    def close(self) -> None:
        if self.opened is not None:
            self.opened.close()
            self.opened = None

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        target = Path(path)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()

