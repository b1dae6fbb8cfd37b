"""Checkpoints stay free of the hybrid layout: saved with replicas (4 ranks, shard groups of K = 2), only the first
shard group writes, the manifest describes a world of 2 ranks, and the checkpoint resumes flat on 2 ranks or hybrid
on 4 ranks; a flat 2-rank checkpoint resumes hybrid on 4. Each resumed run must continue as the uninterrupted run
of the saving layout did (SGD with momentum: per-element optimizer state re-cut for the new layout). Every rank's
RNG is saved, the replicas' too (they write no shards), so a hybrid run with dropout resumes bit-identical."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from ckpt_workers import (
    GLOBAL_BATCH,
    INFO,
    full_state,
    make_optimizer,
    ranks_close,
    resume_then_train,
    save_then_train,
    train_steps,
    trainer_state,
)
from helpers.compare import max_rel_err
from helpers.models import TiedLM, make_batches
from torch import Tensor, nn

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, PARAM_GROUPS_KEY
from zero_strategy.checkpoint.sharded.load import check_compatible, load_optimizer_state, load_weights, restore_rank_rng
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.save import save_sharded
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks

STEPS, SAVE_AT = 5, 2


def _run(worker, world: int, stage: int, k: int | None, path, steps: int = STEPS):  # type: ignore[no-untyped-def]
    layout = {"shard_group_size": k} if k is not None else None
    return run_ranks(worker, world, stage, "sgd", steps, SAVE_AT, str(path), layout, timeout_s=60)


@pytest.mark.timeout(90)
def test_hybrid_checkpoint_resumes_on_any_layout(tmp_path):
    hybrid_ckpt, flat_ckpt = tmp_path / "hybrid", tmp_path / "flat"
    final = _run(save_then_train, 4, 3, 2, hybrid_ckpt)[0]
    manifest = json.loads((hybrid_ckpt / MANIFEST_NAME).read_text())
    assert manifest["world_size"] == 2 and len(manifest["shard_bytes"]) == 2
    shards = sorted(p.name for p in hybrid_ckpt.glob("v-*/*") if "shard" in p.name)
    assert len(shards) == 2, f"only the first shard group writes: {shards}"
    # the steps after the save move the weights well beyond the 1e-5 below: resuming is not a copy of the file
    saved = _run(resume_then_train, 2, 3, None, hybrid_ckpt, steps=SAVE_AT)[0]
    assert max_rel_err(saved, final)[0] > 1e-3
    ranks_close(_run(resume_then_train, 2, 2, None, hybrid_ckpt), final, "hybrid→flat 2")
    ranks_close(_run(resume_then_train, 4, 1, 2, hybrid_ckpt), final, "hybrid→hybrid 4")
    flat_final = _run(save_then_train, 2, 3, None, flat_ckpt)[0]
    ranks_close(_run(resume_then_train, 4, 2, 2, flat_ckpt), flat_final, "flat→hybrid 4")


# ----------------------------------------------------------------------------------------- RNG of every rank
DROPOUT = 0.3


class DroppedLM(TiedLM):
    """The tied language model with dropout after every block: each rank's masks come from its own generator."""

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = nn.functional.dropout(block(h), DROPOUT, self.training)
        return self.head(self.ln_f(h))


def _dropout_engine(layout: dict[str, Any] | None) -> tuple[nn.Module, torch.optim.Optimizer, ZeroEngine]:
    torch.manual_seed(0)
    model = DroppedLM()
    optimizer = make_optimizer("sgd", model.parameters())
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, min_unit_numel=64, **(layout or {})))
    return model, optimizer, engine


def save_with_dropout(rank: int, world: int, path: str) -> dict[str, Any]:
    """The uninterrupted hybrid run: every rank draws its masks from a generator seeded differently."""
    model, optimizer, engine = _dropout_engine({"shard_group_size": 2})
    torch.manual_seed(1000 + rank)
    batches = make_batches(STEPS, 1, GLOBAL_BATCH)
    train_steps(model, optimizer, engine, batches[:SAVE_AT])
    rng_at_save = torch.get_rng_state()
    save_sharded(engine, path, trainer_state(SAVE_AT), INFO)
    train_steps(model, optimizer, engine, batches[SAVE_AT:])
    return {"final": full_state(model, engine), "rng_at_save": rng_at_save}


def resume_with_dropout(rank: int, world: int, path: str, layout: dict[str, Any] | None, restore: str) -> dict:
    """A new process (its generator seeded as the new launch would) loads the checkpoint; ``restore``: "every" rank
    restores its RNG, or only the "first_group" (what checkpoints did before replicas' states were saved)."""
    model, optimizer, engine = _dropout_engine(layout)
    torch.manual_seed(5000 + rank)
    with ShardedCheckpoint(path) as ckpt:
        check_compatible(engine, ckpt, strict=True, with_optimizer=True)
        load_weights(engine, ckpt)
        load_optimizer_state(engine, ckpt, ckpt.trainer_state()[PARAM_GROUPS_KEY])
        if restore == "every" or rank < 2:
            restore_rank_rng(engine, ckpt)
    rng_after_restore = torch.get_rng_state()
    train_steps(model, optimizer, engine, make_batches(STEPS, 1, GLOBAL_BATCH)[SAVE_AT:])
    return {"final": full_state(model, engine), "rng_after_restore": rng_after_restore}


def _bit_identical(got: dict[str, Tensor], ref: dict[str, Tensor]) -> bool:
    return got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.timeout(120)
def test_hybrid_resume_with_dropout_is_bit_identical(tmp_path):
    """4 ranks in shard groups of 2, dropout, saved after 2 of 5 steps: the resumed run ends bit-identical to the
    uninterrupted one on every rank, because every rank's generator state was saved — the replicas' too, though
    only the first shard group writes shards — and each rank restores its own."""
    path = tmp_path / "hybrid"
    hybrid = {"shard_group_size": 2}
    uninterrupted = run_ranks(save_with_dropout, 4, str(path), timeout_s=100)
    assert not torch.equal(uninterrupted[0]["rng_at_save"], uninterrupted[2]["rng_at_save"])  # a rank's own state
    resumed = run_ranks(resume_with_dropout, 4, str(path), hybrid, "every", timeout_s=100)
    for rank, (got, ref) in enumerate(zip(resumed, uninterrupted, strict=True)):
        assert torch.equal(got["rng_after_restore"], ref["rng_at_save"]), f"rank {rank}: not its own RNG state"
        assert _bit_identical(got["final"], ref["final"]), f"rank {rank}: the resumed run differs"
    # the control: with the replicas keeping their own generators the same resume does not end the same
    first_group_only = run_ranks(resume_with_dropout, 4, str(path), hybrid, "first_group", timeout_s=100)
    assert not _bit_identical(first_group_only[0]["final"], uninterrupted[0]["final"])


@pytest.mark.timeout(120)
def test_another_layout_restores_each_rank_by_its_position_in_the_run(tmp_path):
    """A hybrid checkpoint resumed by 2 flat ranks: rank r restores what rank r of the saving run saved (ranks 2 and
    3 had no counterpart to hand theirs to); with the global batch split over 2 ranks the data differ anyway."""
    path = tmp_path / "hybrid"
    uninterrupted = run_ranks(save_with_dropout, 4, str(path), timeout_s=100)
    resumed = run_ranks(resume_with_dropout, 2, str(path), None, "every", timeout_s=100)
    for rank, got in enumerate(resumed):
        assert torch.equal(got["rng_after_restore"], uninterrupted[rank]["rng_at_save"]), f"rank {rank}"
    with ShardedCheckpoint(path) as ckpt:
        assert ckpt.rng_state(4) is None  # the saving run had 4 ranks
