"""Checkpoints stay free of the hybrid layout: saved with replicas (4 ranks, shard groups of K = 2), only the first
shard group writes, the manifest describes a world of 2 ranks, and the checkpoint resumes flat on 2 ranks or hybrid
on 4 ranks; a flat 2-rank checkpoint resumes hybrid on 4. Each resumed run must continue as the uninterrupted run
of the saving layout did (SGD with momentum: per-element optimizer state re-cut for the new layout)."""

from __future__ import annotations

import json

import pytest
from ckpt_workers import ranks_close, resume_then_train, save_then_train

from zero_strategy.checkpoint.format import MANIFEST_NAME
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
    assert max(((final[k] - saved[k]).abs().max() / final[k].abs().max()).item() for k in final) > 1e-3
    ranks_close(_run(resume_then_train, 2, 2, None, hybrid_ckpt), final, "hybrid→flat 2")
    ranks_close(_run(resume_then_train, 4, 1, 2, hybrid_ckpt), final, "hybrid→hybrid 4")
    flat_final = _run(save_then_train, 2, 3, None, flat_ckpt)[0]
    ranks_close(_run(resume_then_train, 4, 2, 2, flat_ckpt), flat_final, "flat→hybrid 4")
