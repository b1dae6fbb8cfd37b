"""Core-level (no Lightning) training, saving and loading for the checkpoint tests, run on forked gloo ranks by
``zero_strategy.testing.run_ranks`` or in-process with one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers.compare import assert_state_close
from helpers.models import lm_loss, make_batches, make_model, rank_slice
from torch import Tensor, nn

from zero_strategy.checkpoint.base.format import PARAM_GROUPS_KEY
from zero_strategy.checkpoint.sharded.load import check_compatible, load_optimizer_state, load_weights
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine

GLOBAL_BATCH = 8
INFO = SaveInfo("32-true", {}, {"zero_strategy": "test", "torch": torch.__version__})


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


def build(
    stage: int, opt_name: str = "adamw", layout: dict[str, Any] | None = None, **model_kwargs: int
) -> tuple[nn.Module, torch.optim.Optimizer, ZeroEngine]:
    """``layout``: further ZeroConfig settings (``shard_group_size``, ``hierarchical_params``)."""
    model = make_model(**model_kwargs)
    optimizer = make_optimizer(opt_name, model.parameters())
    # a low unit threshold: several units, so parameters are spread over several FlatParams and ranks
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, min_unit_numel=64, **(layout or {})))
    return model, optimizer, engine


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, engine: ZeroEngine, batches: list[list[Tensor]]
) -> None:
    """One optimizer step per entry of ``batches``, each rank on its slice of the global batch (split over every
    rank of the run, replicas of hybrid sharding included)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for micro in batches:
        optimizer.zero_grad()
        for tokens in micro:
            (lm_loss(model, rank_slice(tokens, rank, world)) / len(micro)).backward()
        engine.optimizer_step(optimizer)


def full_state(model: nn.Module, engine: ZeroEngine) -> dict[str, Tensor]:
    with engine.gathered_parameters():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer_state(step: int) -> dict[str, Any]:
    """What Lightning would hand the checkpoint IO, reduced to plain data (``optimizer_states`` present: the
    shards carry the optimizer state)."""
    return {"optimizer_states": [{}], "global_step": step, "epoch": 0}


def load_into(engine: ZeroEngine, path: str | Path, with_optimizer: bool = True) -> None:
    """The same order as ShardedCheckpointIO + ZeroStrategy: validate everything, then change the model."""
    with ShardedCheckpoint(path) as ckpt:
        state = ckpt.trainer_state()
        check_compatible(engine, ckpt, strict=True, with_optimizer=with_optimizer)
        load_weights(engine, ckpt)
        if with_optimizer:
            load_optimizer_state(engine, ckpt, state[PARAM_GROUPS_KEY])


def save_then_train(
    rank: int, world: int, stage: int, opt_name: str, steps: int, save_at: int, path: str,
    layout: dict[str, Any] | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """Train ``steps`` steps, saving a checkpoint after ``save_at`` of them; return the final full state."""
    model, optimizer, engine = build(stage, opt_name, layout)
    batches = make_batches(steps, 1, GLOBAL_BATCH)
    train_steps(model, optimizer, engine, batches[:save_at])
    save_sharded(engine, path, trainer_state(save_at), INFO)
    train_steps(model, optimizer, engine, batches[save_at:])
    return full_state(model, engine)


def resume_then_train(
    rank: int, world: int, stage: int, opt_name: str, steps: int, save_at: int, path: str,
    layout: dict[str, Any] | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """Load the checkpoint written by :func:`save_then_train` (any layout) and train the remaining steps."""
    model, optimizer, engine = build(stage, opt_name, layout)
    load_into(engine, path)
    train_steps(model, optimizer, engine, make_batches(steps, 1, GLOBAL_BATCH)[save_at:])
    return full_state(model, engine)


def train_and_save(rank: int, world: int, stage: int, steps: int, path: str, seed: int = 0) -> dict[str, Tensor]:
    """Train ``steps`` AdamW steps (batches drawn from ``seed``), save, return the full state at the save."""
    model, optimizer, engine = build(stage)
    batches = make_batches(steps, 1, GLOBAL_BATCH, seed=seed + 1)
    train_steps(model, optimizer, engine, batches)
    save_sharded(engine, path, trainer_state(steps), INFO)
    return full_state(model, engine)


def ranks_close(results: list[dict[str, Tensor]], final: dict[str, Tensor], what: str) -> None:
    """Every rank's state within 1e-5 (relative to each tensor's largest value) of ``final``."""
    for rank, got in enumerate(results):
        assert_state_close(got, final, rel=1e-5, what=f"{what} rank {rank}")
