"""``consolidate`` / ``zero-to-fp32`` given a plain single-file checkpoint (a Lightning ``.ckpt`` or a torch
state_dict) convert it instead of refusing it. Reference: the tensors that were saved."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from zero_strategy.checkpoint.export.cli import main
from zero_strategy.checkpoint.export.consolidate import consolidate


def _state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model(torch.randn(5, 3))  # moves the running statistics and num_batches_tracked
    state = model.state_dict()
    state["0.weight"] = state["0.weight"].to(torch.bfloat16)  # e.g. a "bf16-true" run's parameter
    return state


def _check_converted(got: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(saved)
    for key, value in saved.items():
        expected = value.float() if value.is_floating_point() else value
        assert got[key].dtype == expected.dtype, key
        assert torch.equal(got[key], expected), key


@dataclasses.dataclass
class HParams:  # an object in the hyper-parameters: needs weights_only=False
    width: int = 4


def test_lightning_file_converts_to_each_format(tmp_path):
    saved = _state_dict()
    lightning_ckpt = {
        "epoch": 2,
        "global_step": 7,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": saved,
        "optimizer_states": [{"state": {}, "param_groups": []}],
        "lr_schedulers": [],
        "hyper_parameters": {"lr": 0.1},
    }
    source = tmp_path / "run.ckpt"
    torch.save(lightning_ckpt, source)
    _check_converted(load_file(consolidate(source, tmp_path / "model.safetensors")), saved)
    _check_converted(torch.load(consolidate(source, tmp_path / "model.pt"), weights_only=True), saved)
    converted = torch.load(consolidate(source, tmp_path / "model.ckpt"), weights_only=True)
    _check_converted(converted["state_dict"], saved)
    assert "optimizer_states" not in converted and "lr_schedulers" not in converted
    assert (converted["global_step"], converted["hyper_parameters"]) == (7, {"lr": 0.1})


def test_cli_converts_a_state_dict_and_names_what_it_cannot_read(tmp_path, capsys):
    saved = _state_dict()
    torch.save(saved, tmp_path / "weights.pt")
    assert main([str(tmp_path / "weights.pt"), str(tmp_path / "out.safetensors"), "--no-progress"]) == 0
    _check_converted(load_file(tmp_path / "out.safetensors"), saved)
    # a .ckpt made from a bare state_dict loads with Lightning's reader: it has the version key
    assert main([str(tmp_path / "weights.pt"), str(tmp_path / "out.ckpt")]) == 0
    assert "pytorch-lightning_version" in torch.load(tmp_path / "out.ckpt", weights_only=True)

    torch.save([1, 2, 3], tmp_path / "list.pt")
    assert main([str(tmp_path / "list.pt"), str(tmp_path / "x.pt")]) == 2
    assert "neither a zero_strategy sharded checkpoint directory" in capsys.readouterr().err

    torch.save({"state_dict": saved, "hyper_parameters": HParams()}, tmp_path / "objects.ckpt")
    assert main([str(tmp_path / "objects.ckpt"), str(tmp_path / "y.pt")]) == 2
    assert "--unsafe-trainer-state" in capsys.readouterr().err
    assert main([str(tmp_path / "objects.ckpt"), str(tmp_path / "y.pt"), "--unsafe-trainer-state"]) == 0
    _check_converted(torch.load(tmp_path / "y.pt", weights_only=True), saved)


def test_missing_checkpoint_is_still_an_error(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        consolidate(tmp_path / "nothing.ckpt", tmp_path / "out.pt")
