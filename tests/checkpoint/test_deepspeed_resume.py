"""Resuming our ZeRO engine from DeepSpeed's checkpoints, against what DeepSpeed itself did after loading them
(the reference: tests/checkpoint/deepspeed_fixtures/record.json, written by DeepSpeed 0.19.8). Our engine starts
from other initial weights, loads the checkpoint at world size 1, 2 or 4 and stage 1, 2 or 3, restores the LR
scheduler from what the checkpoint recorded and runs the 3 recorded steps on the same global batches.

Only the fp32 fixtures are held to DeepSpeed's continuation (1e-5): in bf16 / fp16 DeepSpeed's forward rounds
differently from ours, so the same steps differ by the training dtype's precision, not by a loading error. For
those, what was loaded (weights, Adam moments and step) is compared with the stored partitions exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from deepspeed_files import checkpoint_dir, fixture, fixture_names, zero_to_fp32
from deepspeed_fixtures.make_fixtures import CONTINUED, SAVED_AT, TinyLM, global_batch, param_groups, rank_rows
from helpers.compare import assert_state_close, assert_values_close

from zero_strategy.checkpoint.deepspeed.load import load_deepspeed
from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import RankFailed, run_in_process

FP32 = [name for name in fixture_names("engine") if fixture(name)["precision"] == "fp32"]


def _build(stage: int, optimizer_class: type = torch.optim.AdamW) -> tuple[TinyLM, Any, Any, ZeroEngine]:
    torch.manual_seed(123)  # other initial weights than the DeepSpeed run's: the load must overwrite them
    model = TinyLM()
    model.gain.zero_()  # a buffer the checkpoint must restore, or every loss differs
    optimizer = optimizer_class(param_groups(model), betas=(0.9, 0.95), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, min_unit_numel=16))
    return model, optimizer, scheduler, engine


def _resume(rank: int, world: int, name: str, stage: int) -> dict[str, Any]:
    model, optimizer, scheduler, engine = _build(stage)
    state = load_deepspeed(engine, checkpoint_dir(name))
    scheduler.load_state_dict(state["lr_schedulers"][0])
    steps = [float(s["step"]) for s in optimizer.state.values()]
    losses, lrs = [], []
    for step in range(SAVED_AT, SAVED_AT + CONTINUED):
        lrs.append([group["lr"] for group in optimizer.param_groups])
        optimizer.zero_grad()
        loss = model(rank_rows(global_batch(step), rank, world))
        loss.backward()
        engine.optimizer_step(optimizer)
        scheduler.step()
        losses.append(float(loss.detach()))
    with engine.gathered_parameters():
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    adam_steps = sorted({float(s["step"]) for s in optimizer.state.values()})
    return {"losses": losses, "lrs": lrs, "final": final, "steps_at_load": steps, "adam_steps": adam_steps,
            "global_step": state["global_step"], "lr_after": [g["lr"] for g in optimizer.param_groups]}


def _continuation(name: str, world: int) -> dict[str, Any]:
    """What DeepSpeed did after loading the fixture (a universal one: loaded at this world size, if it was)."""
    entry = fixture(name)
    if "continuation" in entry:
        return dict(entry["continuation"])
    by_world = entry["continuation_by_world_size"]
    return dict(by_world.get(str(world), by_world[str(entry["world_size"])]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", FP32 + fixture_names("universal"))
def test_resume_continues_as_deepspeed_did(name: str, stage: int, world: int) -> None:
    expected = _continuation(name, world)
    results = run_in_process(_resume, world, name, stage)
    mean_losses = [sum(r["losses"][i] for r in results) / world for i in range(CONTINUED)]
    what = f"{name} resumed at stage {stage} on {world} rank(s)"
    assert_values_close(mean_losses, expected["losses"], rel=1e-5, what=what)
    for result in results:
        assert result["global_step"] == expected["global_steps_at_load"] == SAVED_AT
        assert set(result["steps_at_load"]) == {float(SAVED_AT)}
        assert result["adam_steps"] == [expected["adam_step"]]
        assert result["lrs"] == expected["lrs"] and result["lr_after"] == expected["lr_after"]
        reference = {k: torch.tensor(v).view(result["final"][k].shape) for k, v in expected["final_weights"].items()}
        assert_state_close({k: result["final"][k] for k in reference}, reference, rel=1e-5, what=what)


def _loaded_state(rank: int, world: int, name: str, stage: int) -> dict[str, Any]:
    model, optimizer, _, engine = _build(stage)
    load_deepspeed(engine, checkpoint_dir(name))
    with engine.gathered_parameters():
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "steps": sorted({float(s["step"]) for s in optimizer.state.values()})}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in fixture_names("engine") if fixture(n)["precision"] != "fp32"])
def test_bf16_and_fp16_checkpoints_load_their_fp32_masters(name: str) -> None:
    stage = 1 + fixture_names("engine").index(name) % 3  # each stage in turn, reading every fixture
    reference = zero_to_fp32(name)
    for result in run_in_process(_loaded_state, 2, name, stage):
        assert result["steps"] == [float(SAVED_AT)]
        for key, value in reference.items():
            if key in result["weights"] and key != "gain":
                assert torch.equal(result["weights"][key], value.float()), key


def test_an_optimizer_deepspeed_state_does_not_map_onto_is_refused() -> None:
    def resume_with_sgd(rank: int, world: int) -> None:
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.SGD(param_groups(model), lr=0.1, momentum=0.9)
        engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2))
        load_deepspeed(engine, checkpoint_dir("engine_z2_fp32_ws2"))

    with pytest.raises(RankFailed, match=r"CheckpointError.*holds \['exp_avg', 'exp_avg_sq', 'step'\].*this run's SGD"):
        run_in_process(resume_with_sgd, 1)


def test_other_param_groups_are_refused() -> None:
    def resume_with_one_group(rank: int, world: int) -> None:
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=1))
        load_deepspeed(engine, checkpoint_dir("engine_z1_fp32_ws1"))

    refused = r"CheckpointError.*param group 0 of this run holds .*DeepSpeed's groups \[0, 1\]"
    with pytest.raises(RankFailed, match=refused):
        run_in_process(resume_with_one_group, 1)


@pytest.mark.parametrize("name", [n for n in fixture_names("engine") if fixture(n)["precision"] == "fp16"])
def test_the_fp16_loss_scaler_continues_as_deepspeeds(name: str) -> None:
    """DeepSpeed's dynamic loss scaler, translated into ours (see [Note: DeepSpeed's loss-scale window] in
    checkpoint/deepspeed/load.py), with the fixture's knobs (window 2, hysteresis 2): the state at the load and
    after the 3 recorded clean steps is what DeepSpeed's was."""
    from zero_strategy.checkpoint.deepspeed.load import loss_scaler_state
    from zero_strategy.core.engine.loss_scaler import DynamicLossScaler, LossScalerConfig

    with DeepSpeedCheckpoint(checkpoint_dir(name)) as ckpt:
        state = loss_scaler_state(ckpt)
    assert state is not None
    expected = fixture(name)["continuation"]
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=8, loss_scale_window=2, hysteresis=2))
    scaler.load_state_dict(state)
    at_load = expected["loss_scaler_at_load"]
    assert (scaler.scale, scaler.hysteresis_left, scaler.iteration) == (
        at_load["cur_scale"], at_load["cur_hysteresis"], at_load["cur_iter"])
    for _ in range(CONTINUED):
        scaler.update(overflow=False)
    after = expected["loss_scaler_after"]
    assert (scaler.scale, scaler.hysteresis_left, scaler.iteration) == (
        after["cur_scale"], after["cur_hysteresis"], after["cur_iter"])


def test_fp32_and_bf16_checkpoints_have_no_loss_scaler_to_carry() -> None:
    from zero_strategy.checkpoint.deepspeed.load import loss_scaler_state

    for name in ("engine_z2_fp32_ws2", "engine_z1_bf16_ws2", "engine_z3_bf16_ws1"):
        with DeepSpeedCheckpoint(checkpoint_dir(name)) as ckpt:
            assert loss_scaler_state(ckpt) is None


def _resume_from_dcp(rank: int, world: int, path: str, stage: int) -> dict[str, Any]:
    from zero_strategy.checkpoint.dcp.load import load_dcp

    model, optimizer, scheduler, engine = _build(stage)
    state = load_dcp(engine, path)
    scheduler.load_state_dict(state["lr_schedulers"][0])
    losses = []
    for step in range(SAVED_AT, SAVED_AT + CONTINUED):
        optimizer.zero_grad()
        loss = model(rank_rows(global_batch(step), rank, world))
        loss.backward()
        engine.optimizer_step(optimizer)
        scheduler.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "global_step": state["global_step"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "stage", "world"), [("engine_z3_fp32_ws2", 2, 2), ("engine_z1_fp32_ws1", 3, 4)])
def test_zero_to_dcp_of_a_deepspeed_checkpoint_resumes_as_deepspeed_did(name: str, stage: int, world: int,
                                                                          tmp_path) -> None:
    """``zero-to-dcp DEEPSPEED_DIR OUT``: weights, Adam state and trainer state in a DCP directory, which our
    engine resumes from and continues as DeepSpeed did."""
    from zero_strategy.checkpoint.dcp.cli import main

    assert main([str(checkpoint_dir(name)), str(tmp_path / "dcp")]) == 0
    expected = fixture(name)["continuation"]
    results = run_in_process(_resume_from_dcp, world, str(tmp_path / "dcp"), stage)
    mean_losses = [sum(r["losses"][i] for r in results) / world for i in range(CONTINUED)]
    assert_values_close(mean_losses, expected["losses"], rel=1e-5, what=f"{name} through zero-to-dcp")
    assert results[0]["global_step"] == SAVED_AT
