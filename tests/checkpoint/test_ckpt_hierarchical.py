"""Checkpoints stay free of hierarchical stage 3's secondary copies: saved with ``hierarchical_params="node"`` on 4
ranks as 2 nodes × 2, a checkpoint resumes flat on 2 ranks; a flat 2-rank checkpoint resumes hierarchical on 4. Each
resumed run must continue as the uninterrupted run of the saving layout did (SGD with momentum), which it cannot if
the resumed engine gathered the secondary copies it built before the load instead of the loaded shards."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from ckpt_workers import GLOBAL_BATCH, build, full_state, load_into, ranks_close, save_then_train, train_steps
from helpers.models import make_batches
from torch import Tensor

from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks

STEPS, SAVE_AT = 5, 2


def _engine(hierarchical: str | None) -> tuple[torch.nn.Module, torch.optim.Optimizer, ZeroEngine]:
    model, optimizer, engine = build(3, "sgd", {"hierarchical_params": hierarchical})
    assert (engine.comms.secondary is not None) == (hierarchical is not None)
    return model, optimizer, engine


def as_two_nodes(rank: int, world: int, worker: Any, *args: Any) -> Any:
    """``worker`` on a rank of 4 launched as 2 nodes of 2: torchrun sets ``LOCAL_WORLD_SIZE`` in each rank's
    environment, and so does this wrapper (the harness gives every rank the launcher variables the test session
    started with, not the parent's)."""
    os.environ["LOCAL_WORLD_SIZE"] = "2" if world == 4 else str(world)
    return worker(rank, world, *args)


def resume_then_train(rank: int, world: int, hierarchical: str | None, path: str) -> dict[str, Tensor]:
    """Load into an engine whose secondary copies are fresh (hierarchical) and train the remaining steps."""
    model, optimizer, engine = _engine(hierarchical)
    batches = make_batches(STEPS, 1, GLOBAL_BATCH, seed=7)
    train_steps(model, optimizer, engine, batches[:1])  # other values first, then a gather: the secondary copies
    full_state(model, engine)  # are fresh when the load replaces the shards under them
    load_into(engine, path)
    train_steps(model, optimizer, engine, make_batches(STEPS, 1, GLOBAL_BATCH)[SAVE_AT:])
    return full_state(model, engine)


@pytest.mark.timeout(90)
def test_hierarchical_checkpoint_resumes_flat_and_back(tmp_path):
    hier_ckpt, flat_ckpt = tmp_path / "hierarchical", tmp_path / "flat"
    node = {"hierarchical_params": "node"}
    final = run_ranks(as_two_nodes, 4, save_then_train, 3, "sgd", STEPS, SAVE_AT, str(hier_ckpt), node,
                      timeout_s=60)[0]
    ranks_close(run_ranks(as_two_nodes, 2, resume_then_train, None, str(hier_ckpt), timeout_s=60), final,
                "hierarchical→flat 2")
    flat_final = run_ranks(as_two_nodes, 2, save_then_train, 3, "sgd", STEPS, SAVE_AT, str(flat_ckpt),
                           timeout_s=60)[0]
    ranks_close(run_ranks(as_two_nodes, 4, resume_then_train, "node", str(flat_ckpt), timeout_s=60), flat_final,
                "flat→hier 4")
