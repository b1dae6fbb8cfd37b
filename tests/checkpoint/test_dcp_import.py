"""Reading DCP checkpoints into ZeRO: our own DCP checkpoint resumes on another world size and stage like the run
that wrote it; ``open_pretrained`` reads any element range of its model tensors; a parameter the checkpoint has
no optimizer state for borrows its group's ``step``; damaged checkpoints, another model's checkpoint, one without
optimizer state or without trainer state are clear errors; ``checkpoint_format`` is validated."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_workers import INFO, build, trainer_state
from dcp_workers import assert_close, zero_resume_from_dcp, zero_save_then_train
from helpers.models import make_model

from zero_strategy.checkpoint.base.format import NO_OPTIMIZER_STATE_KEY, CheckpointError
from zero_strategy.checkpoint.dcp.export import export_to_dcp
from zero_strategy.checkpoint.dcp.load import load_dcp
from zero_strategy.checkpoint.dcp.reader import DcpCheckpoint
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.pretrained.open import load_pretrained_into_module, open_pretrained
from zero_strategy.checkpoint.sharded.module_snapshot import ModuleSnapshot
from zero_strategy.checkpoint.sharded.save import save_sharded
from zero_strategy.checkpoint.strategy_io.writer_choice import save_checkpoint_as
from zero_strategy.config import CheckpointFormat, ZeroConfig, ZeroConfigError
from zero_strategy.testing import run_ranks

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """2 ranks, stage 3: our own format and an online DCP checkpoint at the same step, and the final state."""
    root = tmp_path_factory.mktemp("zero3")
    final = run_ranks(zero_save_then_train, 2, 3, str(root / "zero"), str(root / "online"), timeout_s=90)[0]
    return root, final


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("stage", "world"), [(1, 4), (2, 1)])
def test_our_dcp_checkpoint_resumes_on_another_layout(zero3_run, stage, world):
    root, final = zero3_run
    for rank, result in enumerate(run_ranks(zero_resume_from_dcp, world, stage, str(root / "online"), timeout_s=90)):
        assert_close(result["final"], final, TOLERANCE, f"zero3 on 2 ranks → zero{stage} on {world}, rank {rank}")
        assert result["trainer_state"]["global_step"] == 2


@pytest.mark.timeout(120)
def test_pretrained_reads_any_range_of_a_dcp_checkpoint(zero3_run, tmp_path):
    root, _ = zero3_run
    consolidate(root / "zero", tmp_path / "full.pt", progress=False)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    with open_pretrained(root / "online") as source:
        assert sorted(source.keys()) == sorted(full), "the model's keys only, not the optimizer's or ours"
        for name, tensor in full.items():
            assert source.shape(name) == tuple(tensor.shape)
            flat = tensor.reshape(-1)
            for _ in range(6):
                start = int(torch.randint(0, flat.numel() + 1, (), generator=g))
                count = int(torch.randint(0, flat.numel() - start + 1, (), generator=g))
                assert torch.equal(source.read(name, start, count), flat[start : start + count]), (name, start)
    module = make_model(seed=3)
    load_pretrained_into_module(module, root / "online")
    for key, value in module.state_dict().items():
        assert torch.equal(value, full[key]), key


SINGLE_PROCESS_SAVE = "ignore:torch.distributed is disabled"  # dcp.save's notice when called without a group


@pytest.mark.filterwarnings(SINGLE_PROCESS_SAVE)
def test_a_parameter_without_optimizer_state_borrows_its_groups_step(tmp_path):
    """A never-stepped parameter (no state, as torch leaves it) next to a stepped one in one param group: its
    per-element state reads as zeros, its step is the group's — one master piece holds both."""
    a, b = torch.randn(3, 4), torch.randn(5)
    state = {"a": {"exp_avg": torch.full((3, 4), 0.5), "exp_avg_sq": torch.ones(3, 4), "step": torch.tensor(7.0)}}
    groups = [{"lr": 0.1, "params": ["a", "b"]}]
    content = {"model": {"a": a, "b": b}, "optim": {"state": state, "param_groups": groups}}
    dcp.save(content, checkpoint_id=tmp_path / "ck", no_dist=True)
    ckpt = DcpCheckpoint(tmp_path / "ck")
    flat_b = ckpt.params["b"][0]
    assert ckpt.state_names(flat_b) == ["exp_avg", "exp_avg_sq"]
    assert torch.equal(ckpt.read_param("b", "optim:exp_avg"), torch.zeros(5))
    assert ckpt.scalar_state_at(flat_b, 0)["step"]["value"] == 7.0
    assert torch.equal(ckpt.read_param("a", "optim:exp_avg"), torch.full((12,), 0.5))
    assert torch.equal(ckpt.read_param("b", "flat", 1, 3), b[1:4])


def _saved_export(tmp_path):
    _, _, engine = build(3)
    save_sharded(engine, tmp_path / "zero", trainer_state(0), INFO)
    export_to_dcp(tmp_path / "zero", tmp_path / "dcp")
    return tmp_path / "dcp"


def test_damaged_checkpoints_name_the_file(tmp_path):
    path = _saved_export(tmp_path)
    [data] = path.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{data.name} is truncated"):
        DcpCheckpoint(path)
    data.unlink()
    with pytest.raises(CheckpointError, match=rf"{data.name} is missing"):
        DcpCheckpoint(path)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        DcpCheckpoint(path)


def test_another_models_checkpoint_is_refused_before_anything_changes(tmp_path):
    path = _saved_export(tmp_path)
    _, _, engine = build(3, width=17)
    before = [flat.shard.clone() for flat in engine.flat_params]
    with pytest.raises(CheckpointError, match="checkpoint of another model: shape mismatch"):
        load_dcp(engine, path)
    assert all(torch.equal(flat.shard, old) for flat, old in zip(engine.flat_params, before, strict=True))


def test_a_weights_only_checkpoint_cannot_resume_a_fit_and_says_why(tmp_path):
    model = make_model()
    config = ZeroConfig(stage=3, checkpoint_format="dcp")
    info = dataclasses.replace(INFO, extra={NO_OPTIMIZER_STATE_KEY: "saved outside fit"})
    save_checkpoint_as(config.checkpoint_format, ModuleSnapshot(model, config), tmp_path / "w", {"global_step": 3},
                       info)  # a module's own weights, no engine (checkpoint/sharded/module_snapshot.py)
    assert (tmp_path / "w" / ".metadata").is_file()
    _, _, engine = build(3, seed=9)
    with pytest.raises(CheckpointError, match=r"holds no optimizer state \(saved outside fit\)"):
        load_dcp(engine, tmp_path / "w")
    assert load_dcp(engine, tmp_path / "w", with_optimizer=False) == {"global_step": 3}
    with engine.gathered_parameters():
        for key, value in engine.module.state_dict().items():
            assert torch.equal(value, model.state_dict()[key]), key


@pytest.mark.filterwarnings(SINGLE_PROCESS_SAVE)
def test_lightning_resume_needs_a_trainer_state(tmp_path):
    from zero_strategy.lightning.checkpoint_io import ShardedCheckpointIO

    _, _, engine = build(3)
    dcp.save({"model": make_model().state_dict()}, checkpoint_id=tmp_path / "plain", no_dist=True)
    io_plugin = ShardedCheckpointIO()
    io_plugin.attach(engine, "32-true")
    with pytest.raises(CheckpointError, match=r"without Lightning's trainer state .* pass pretrained="):
        io_plugin.load_checkpoint(tmp_path / "plain")


def test_checkpoint_format_is_validated():
    assert ZeroConfig(checkpoint_format="dcp").checkpoint_format is CheckpointFormat.dcp
    assert ZeroConfig().checkpoint_format is CheckpointFormat.zero
    with pytest.raises(ZeroConfigError, match=r"checkpoint_format='fsdp': use 'zero' .* or 'dcp'"):
        ZeroConfig(checkpoint_format="fsdp")
