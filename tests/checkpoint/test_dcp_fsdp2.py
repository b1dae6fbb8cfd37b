"""DCP interchange with FSDP2 (torch's ``fully_shard``, 2 gloo ranks on a CPU device mesh), checked against the
other side continuing: FSDP2 loads our export with ``dcp.load`` + ``set_model_state_dict`` /
``set_optimizer_state_dict`` and trains exactly as our run trains on; our engine resumes FSDP2's checkpoint at
stage 3 on 1, 2 and 4 ranks and trains exactly as FSDP2 trains on (1e-5 relative over 3 AdamW steps). Also
Lightning's ModelParallelStrategy layout (``state_dict.*``, ``optimizer_0.*``, ``meta.pt``) and ``pretrained=``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_workers import build
from dcp_workers import (
    SAVE_AT,
    assert_close,
    fsdp2_resume,
    fsdp2_save_then_train,
    zero_resume_from_dcp,
    zero_save_then_train,
)
from helpers.models import make_model

from zero_strategy.checkpoint.dcp.export import export_to_dcp
from zero_strategy.config import ZeroConfig
from zero_strategy.lightning.checkpoint_io import ShardedCheckpointIO
from zero_strategy.testing import run_ranks

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> tuple[Path, dict]:
    """A 2-rank FSDP2 run: its DCP checkpoint after SAVE_AT steps, and its full state then and at the end."""
    path = tmp_path_factory.mktemp("fsdp2") / "ckpt"
    return path, run_ranks(fsdp2_save_then_train, 2, str(path), timeout_s=90)[0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp2_continues_from_our_export(tmp_path, stage):
    ours = run_ranks(zero_save_then_train, 2, stage, str(tmp_path / "zero"), timeout_s=90)[0]
    export_to_dcp(tmp_path / "zero", tmp_path / "dcp")
    theirs = run_ranks(fsdp2_resume, 2, str(tmp_path / "dcp"), timeout_s=90)
    for rank, state in enumerate(theirs):
        assert_close(state, ours, TOLERANCE, f"FSDP2 rank {rank} continuing our zero{stage} export")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_zero3_resumes_an_fsdp2_checkpoint(fsdp2_run, world):
    path, fsdp2 = fsdp2_run
    for rank, result in enumerate(run_ranks(zero_resume_from_dcp, world, 3, str(path), timeout_s=90)):
        assert_close(result["final"], fsdp2["final"], TOLERANCE, f"zero3 rank {rank}/{world} vs FSDP2")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["lightning", "torchtitan"])
def test_other_tools_layouts(tmp_path, layout):
    """Lightning's ModelParallelStrategy writes ``{"state_dict": ..., "optimizer_0": ...}`` and its trainer state
    to ``meta.pt``; torchtitan writes the model's keys at the top level and the optimizer flattened per parameter
    (``optimizer.param_groups.<fqn>.lr``): our engine finds both and resumes at stage 2 like FSDP2 continuing."""
    path = tmp_path / "ckpt"
    fsdp2 = run_ranks(fsdp2_save_then_train, 2, str(path), layout, timeout_s=90)[0]
    results = run_ranks(zero_resume_from_dcp, 2, 2, str(path), timeout_s=90)
    for rank, result in enumerate(results):
        assert_close(result["final"], fsdp2["final"], TOLERANCE, f"zero2 rank {rank} vs FSDP2 ({layout} layout)")
        expected_state = {"global_step": SAVE_AT} if layout == "lightning" else {}
        assert {k: v for k, v in result["trainer_state"].items() if k == "global_step"} == expected_state
    if layout == "lightning":  # what ZeroStrategy's checkpoint IO makes of it for trainer.fit(ckpt_path=...)
        _, _, engine = build(2)
        io_plugin = ShardedCheckpointIO()
        io_plugin.attach(engine, "32-true")
        state = io_plugin.load_checkpoint(path)
        assert state["global_step"] == SAVE_AT
        assert state["optimizer_states"] == [{}], "meta.pt leaves it out; Lightning restores optimizers only with it"
        io_plugin.check(io_plugin.opened, strict=True, with_optimizer=True)
        assert io_plugin.param_groups[0][0]["lr"] == 1e-2 and set(io_plugin.buffers) == set()
        io_plugin.close()


def _pretrained_worker(rank: int, world: int, path: str) -> dict:
    from ckpt_workers import full_state

    from zero_strategy.core.engine.engine import ZeroEngine
    from zero_strategy.initial_values import initial_values

    model = make_model(seed=7)
    config = ZeroConfig(stage=3, min_unit_numel=64, pretrained=path)
    with initial_values(model, None, config, torch.device("cpu")) as values:
        engine = ZeroEngine(model, [], config, initial_values=values)
    return full_state(model, engine)


@pytest.mark.timeout(120)
def test_pretrained_from_an_fsdp2_checkpoint(fsdp2_run):
    """``pretrained=<DCP dir>``: each rank reads its ranges of FSDP2's model tensors (not its optimizer state)."""
    path, fsdp2 = fsdp2_run
    for rank, state in enumerate(run_ranks(_pretrained_worker, 2, str(path), timeout_s=90)):
        assert_close(state, fsdp2["at_save"], 0.0, f"rank {rank}: pretrained= from FSDP2's DCP checkpoint")
