"""Checkpoints stay free of the hybrid layout: saved with replicas (4 ranks, shard groups of K = 2), only the first
shard group writes, the manifest describes a world of 2 ranks, and the checkpoint resumes flat on 2 ranks or hybrid
on 4 ranks; a flat 2-rank checkpoint resumes hybrid on 4. Each resumed run must continue as the uninterrupted run
of the saving layout did (SGD with momentum: per-element optimizer state re-cut for the new layout)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from ckpt_workers import (
    GLOBAL_BATCH,
    INFO,
    full_state,
    load_into,
    make_optimizer,
    ranks_close,
    trainer_state,
)
from helpers.models import lm_loss, make_batches, make_model, rank_slice
from torch import Tensor

from zero_strategy.checkpoint.format import MANIFEST_NAME
from zero_strategy.checkpoint.save import save_sharded
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine import ZeroEngine
from zero_strategy.testing import run_ranks

STEPS, SAVE_AT = 5, 2


def _engine(stage: int, shard_group_size: int | None) -> tuple[torch.nn.Module, torch.optim.Optimizer, ZeroEngine]:
    model = make_model()
    optimizer = make_optimizer("sgd", model.parameters())
    config = ZeroConfig(stage=stage, min_unit_numel=64, shard_group_size=shard_group_size)
    return model, optimizer, ZeroEngine(model, [optimizer], config)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: ZeroEngine, batches: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()  # data is split over the whole world, replicas included
    for micro in batches:
        optimizer.zero_grad()
        for tokens in micro:
            lm_loss(model, rank_slice(tokens, rank, world)).backward()
        engine.optimizer_step(optimizer)


def save_then_train(rank: int, world: int, stage: int, k: int | None, path: str) -> dict[str, Tensor]:
    model, optimizer, engine = _engine(stage, k)
    batches = make_batches(STEPS, 1, GLOBAL_BATCH)
    _train(model, optimizer, engine, batches[:SAVE_AT])
    save_sharded(engine, path, trainer_state(SAVE_AT), INFO)
    _train(model, optimizer, engine, batches[SAVE_AT:])
    return full_state(model, engine)


def resume_then_train(rank: int, world: int, stage: int, k: int | None, path: str) -> dict[str, Tensor]:
    model, optimizer, engine = _engine(stage, k)
    load_into(engine, path)
    _train(model, optimizer, engine, make_batches(STEPS, 1, GLOBAL_BATCH)[SAVE_AT:])
    return full_state(model, engine)


@pytest.mark.timeout(90)
def test_hybrid_checkpoint_resumes_on_any_layout(tmp_path):
    hybrid_ckpt, flat_ckpt = tmp_path / "hybrid", tmp_path / "flat"
    final = run_ranks(save_then_train, 4, 3, 2, str(hybrid_ckpt), timeout_s=60)[0]
    manifest = json.loads((hybrid_ckpt / MANIFEST_NAME).read_text())
    assert manifest["world_size"] == 2 and len(manifest["shard_bytes"]) == 2
    shards = sorted(p.name for p in hybrid_ckpt.glob("v-*/*") if "shard" in p.name)
    assert len(shards) == 2, f"only the first shard group writes: {shards}"
    start = run_ranks(resume_then_train, 1, 1, None, str(hybrid_ckpt), timeout_s=60)[0]
    assert any(not torch.equal(start[k], final[k]) for k in final)  # sanity: the fixtures differ
    ranks_close(run_ranks(resume_then_train, 2, 2, None, str(hybrid_ckpt), timeout_s=60), final, "hybrid→flat 2")
    ranks_close(run_ranks(resume_then_train, 4, 1, 2, str(hybrid_ckpt), timeout_s=60), final, "hybrid→hybrid 4")
    flat_final = run_ranks(save_then_train, 2, 3, None, str(flat_ckpt), timeout_s=60)[0]
    ranks_close(run_ranks(resume_then_train, 4, 2, 2, str(flat_ckpt), timeout_s=60), flat_final, "flat→hybrid 4")
