"""Reading DeepSpeed checkpoints without DeepSpeed: safe unpickling, the layouts and their refusals, and every
fixture's fp32 weights against DeepSpeed's own zero_to_fp32 output (the reference: made by DeepSpeed 0.19.8 when
the fixtures were written; see tests/checkpoint/deepspeed_fixtures/README.md)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from deepspeed_files import checkpoint_dir, fixture, fixture_names, record, write_layout, zero_to_fp32

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.deepspeed.layout import find_files, is_deepspeed_directory
from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zero_strategy.checkpoint.deepspeed.unpickle import FragmentAddress, LossScalerState, ZeroStage, load_deepspeed_file
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.pretrained.open import load_pretrained_into_module, open_pretrained

ENGINE = fixture_names("engine")
CONSOLIDATED = ENGINE + fixture_names("universal") + fixture_names("lightning")


class _RunsCode:
    """Unpickling this calls ``exec`` on a line that writes a file: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_the_record_names_deepspeeds_versions() -> None:
    versions = record()["versions"]
    assert versions["deepspeed"] == "0.19.8" and versions["torch"].startswith("2.13.0")
    assert len(ENGINE) == 18  # stages 1-3 x fp32/bf16/fp16 x world sizes 1, 2


def test_a_pickle_that_runs_code_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    root = write_layout(tmp_path / "ckpt", {"module": {}, "param_shapes": []},
                        [{"optimizer_state_dict": {"zero_stage": _RunsCode(marker)}}])
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt was refused.*exec"):
        DeepSpeedCheckpoint(root)
    assert not marker.exists()


def test_a_deepspeed_class_the_format_does_not_need_is_refused(tmp_path: Path, monkeypatch) -> None:
    fake = types.ModuleType("deepspeed.runtime.engine")

    class DeepSpeedEngine:
        pass

    DeepSpeedEngine.__module__ = fake.__name__
    DeepSpeedEngine.__qualname__ = "DeepSpeedEngine"
    fake.DeepSpeedEngine = DeepSpeedEngine  # type: ignore[attr-defined]
    for parent in ("deepspeed", "deepspeed.runtime"):  # pickle imports the module path to check it (the test only)
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    torch.save({"engine": DeepSpeedEngine()}, tmp_path / "f.pt")
    with pytest.raises(CheckpointError, match=r"deepspeed\.runtime\.engine\.DeepSpeedEngine"):
        load_deepspeed_file(tmp_path / "f.pt")


def test_deepspeeds_own_objects_become_stand_ins() -> None:
    name = "engine_z2_fp16_ws2"
    part = load_deepspeed_file(next((checkpoint_dir(name) / "global_step2").glob("zero_pp_rank_0_*optim*")))
    state = part["optimizer_state_dict"]
    assert isinstance(state["loss_scaler"], LossScalerState)
    scaler = fixture(name)["loss_scaler_at_save"]
    assert {k: state["loss_scaler"].fields()[k] for k in scaler} == scaler
    assert state["zero_stage"] is ZeroStage.gradients
    assert all(isinstance(a, FragmentAddress) for group in state["param_slice_mappings"] for a in group.values())


@pytest.mark.parametrize("name", CONSOLIDATED)
def test_fp32_weights_equal_deepspeeds_zero_to_fp32(name: str, tmp_path: Path) -> None:
    """Exactly, key by key, including tied and frozen parameters (frozen ones cast to fp32 as ours are; at stage 1
    DeepSpeed's tool leaves frozen parameters out, ours reads them from the module entry). A universal fixture's
    reference is zero_to_fp32 of the checkpoint ds_to_universal converted; a Lightning fixture's keys are the
    LightningModule's (DeepSpeed's wrapper prefix removed)."""
    prefix = "_forward_module." if fixture(name)["layout"] == "lightning" else ""
    reference = {k.removeprefix(prefix): v for k, v in zero_to_fp32(name).items()}
    out = consolidate(checkpoint_dir(name), tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    ours = load_file(out)
    assert set(reference) <= set(ours)
    for key, value in reference.items():
        expected = value.float() if value.is_floating_point() else value
        assert torch.equal(ours[key], expected), key
    frozen = {f"{'model.' if prefix else ''}frozen.{p}" for p in ("weight", "bias")}
    assert set(ours) - set(reference) <= (frozen if fixture(name)["stage"] == 1 else set())


@pytest.mark.parametrize("name", ["engine_z1_bf16_ws2", "engine_z2_fp32_ws2", "engine_z3_fp16_ws2"])
def test_element_ranges_across_rank_partitions(name: str) -> None:
    reference = zero_to_fp32(name)
    with DeepSpeedCheckpoint(checkpoint_dir(name)) as ckpt:
        for key in ("embed.weight", "body.weight", "norm.bias", "head.weight"):
            whole = reference[key].float().reshape(-1)
            for start in range(whole.numel()):
                for count in (1, 5, whole.numel() - start):
                    count = min(count, whole.numel() - start)
                    assert torch.equal(ckpt.read_param(key, "flat", start, count), whole[start : start + count])


def test_pretrained_from_a_deepspeed_directory(tmp_path: Path) -> None:
    from deepspeed_fixtures.make_fixtures import TinyLM

    name = "engine_z3_bf16_ws2"
    reference = zero_to_fp32(name)
    model = TinyLM()
    with open_pretrained(checkpoint_dir(name)) as source:
        assert torch.equal(source.read("body.weight", 4, 9), reference["body.weight"].reshape(-1)[4:13])
    load_pretrained_into_module(model, checkpoint_dir(name))
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key].float()), key


def test_the_universal_layout_holds_the_same_state_as_the_checkpoint_it_was_made_from() -> None:
    """ds_to_universal's whole tensors read as the partitions they came from were read: weights, moments, step,
    hyper-parameters (the universal fixture was converted from a save of the same run as engine_z2_fp32_ws2)."""
    from zero_strategy.checkpoint.deepspeed.universal import UniversalCheckpoint, open_deepspeed

    universal = open_deepspeed(checkpoint_dir("universal_z2_fp32_ws2"))
    partitioned = open_deepspeed(checkpoint_dir("engine_z2_fp32_ws2"))
    assert isinstance(universal, UniversalCheckpoint) and not isinstance(partitioned, UniversalCheckpoint)
    assert universal.param_groups() == partitioned.param_groups()
    assert universal.stored_state_names() == partitioned.stored_state_names()
    for name, (flat, _) in partitioned.params.items():
        assert universal.state_names(flat) == partitioned.state_names(flat), name
        assert universal.scalar_state_at(flat, 0) == partitioned.scalar_state_at(flat, 0), name
        for tensor_of in ["flat"] + [f"optim:{state}" for state in partitioned.state_names(flat)]:
            assert torch.equal(universal.read_param(name, tensor_of), partitioned.read_param(name, tensor_of))


def test_every_level_of_the_layout_is_recognised() -> None:
    root = checkpoint_dir("engine_z2_fp32_ws2")
    assert is_deepspeed_directory(root) and is_deepspeed_directory(root / "global_step2")
    assert find_files(root).tag_dir == find_files(root / "global_step2").tag_dir == root / "global_step2"
    assert not is_deepspeed_directory(root.parent)


def _copy(name: str, to: Path) -> Path:
    import shutil

    shutil.copytree(checkpoint_dir(name), to)
    return to


@pytest.mark.parametrize(
    ("extra_file", "named"),
    [
        ("mp_rank_01_model_states.pt", "tensor-parallel"),
        ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "tensor-parallel"),
        ("layer_01-model_00-model_states.pt", "pipeline-parallel"),
        ("expp_rank_0_mp_rank_00_optim_states.pt", "expert"),
    ],
)
def test_unsupported_layouts_are_refused_naming_what_was_found(tmp_path: Path, extra_file: str, named: str) -> None:
    root = _copy("engine_z2_fp32_ws1", tmp_path / "ckpt")
    (root / "global_step2" / extra_file).write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{named}.*{extra_file}.*supported: DeepSpeed ZeRO stage 1, 2 or 3"):
        DeepSpeedCheckpoint(root)


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    root = _copy("engine_z2_fp32_ws2", tmp_path / "ckpt")
    (root / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"ranks \[0\] are missing"):
        DeepSpeedCheckpoint(root)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    root = _copy("engine_z3_fp32_ws2", tmp_path / "ckpt")
    victim = root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt could not be read"):
        DeepSpeedCheckpoint(root)


def test_zero_to_fp32_cli_writes_a_lightning_checkpoint_from_a_deepspeedstrategy_directory(tmp_path: Path) -> None:
    """``zero-to-fp32 X.ckpt out.ckpt``: the LightningModule's state dict (its own key names) and Lightning's
    trainer state from DeepSpeed's client state, for load_from_checkpoint; streamed as for our format."""
    from zero_strategy.checkpoint.export.cli import main

    name = "lightning_z3_fp32_ws2"
    assert main([str(checkpoint_dir(name)), str(tmp_path / "out.ckpt"), "--no-progress"]) == 0
    content = torch.load(tmp_path / "out.ckpt", weights_only=True)
    assert content["global_step"] == 2 and "loops" in content and "optimizer_states" not in content
    reference = zero_to_fp32(name)
    for key, value in reference.items():
        assert torch.equal(content["state_dict"][key.removeprefix("_forward_module.")], value.float()), key


def test_hf_export_from_a_deepspeed_directory(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from zero_strategy.checkpoint.export.hf_export import consolidate_hf

    name = "engine_z3_bf16_ws2"
    out = consolidate_hf(checkpoint_dir(name), tmp_path / "hf", {"model_type": "tiny", "architectures": ["TinyLM"]},
                         check_names=False,
                         progress=False)
    written = load_file(out / "model.safetensors")
    reference = zero_to_fp32(name)
    assert "head.weight" not in written  # the tied alias, stored once as Hugging Face does
    for key, value in written.items():
        assert torch.equal(value, reference[key].float()), key


def _pretrained_build(rank: int, world: int, name: str, stage: int) -> dict[str, torch.Tensor]:
    """A meta-built TinyLM sharded with ``pretrained=`` the DeepSpeed directory, as ZeroStrategy builds it: each
    rank fills its own slices from the ranges it owns."""
    from deepspeed_fixtures.make_fixtures import TinyLM

    from zero_strategy.config import ZeroConfig
    from zero_strategy.core.engine.engine import ZeroEngine
    from zero_strategy.core.init import record_construction
    from zero_strategy.initial_values import initial_values

    with record_construction() as recording:
        model = TinyLM()
    config = ZeroConfig(stage=stage, min_unit_numel=16, pretrained=str(checkpoint_dir(name)))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with initial_values(model, recording, config, torch.device("cpu")) as values:
        engine = ZeroEngine(model, [optimizer], config, initial_values=values)
    with engine.gathered_parameters():
        return {key: value.detach().clone() for key, value in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "stage", "world"), [("engine_z3_fp16_ws2", 3, 2), ("engine_z2_fp32_ws1", 1, 3)])
def test_pretrained_deepspeed_directory_in_a_sharded_build(name: str, stage: int, world: int) -> None:
    from zero_strategy.testing import run_ranks

    reference = zero_to_fp32(name)
    for rank, loaded in enumerate(run_ranks(_pretrained_build, world, name, stage, timeout_s=100)):
        for key, value in reference.items():
            expected = value.float() if key != "gain" else value
            assert torch.equal(loaded[key], expected), f"{key} on rank {rank}"


def test_an_optimizer_state_not_in_the_file_is_named(tmp_path: Path) -> None:
    """What a checkpoint holds in place of a tensor kept elsewhere (here a path string, as a swapped-out NVMe tensor
    would be): refused when read, naming the file, the state and the partition."""
    from collections import OrderedDict

    model = {"module": OrderedDict(w=torch.zeros(4)), "buffer_names": [],
             "param_shapes": [OrderedDict(w=torch.Size([4]))], "frozen_param_shapes": None, "shared_params": {}}
    part = {"optimizer_state_dict": {
        "zero_stage": 2, "single_partition_of_fp32_groups": [torch.ones(4)],
        "base_optimizer_state": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": "/nvme/swap/exp_avg_0.tensor",
                                               "exp_avg_sq": torch.ones(4)}}, "param_groups": [{"lr": 0.1}]},
    }}
    with DeepSpeedCheckpoint(write_layout(tmp_path / "ckpt", model, [part])) as ckpt:
        assert torch.equal(ckpt.read_param("w"), torch.ones(4))
        with pytest.raises(CheckpointError, match=r"optim_states\.pt: exp_avg of partition 0 is a str.*NVMe"):
            ckpt.read_param("w", "optim:exp_avg")
