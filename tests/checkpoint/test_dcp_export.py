"""``zero-to-dcp``: a sharded checkpoint of any stage and world size, rewritten as a torch.distributed.checkpoint
directory without gathering. What torch's own converter (``dcp_to_torch_save``) reads from it equals what
``consolidate`` reads from the original (every model key and value), and its optimizer state equals what our
reader gives for each parameter; the chunks follow the ranks' slices; the CLI's exit codes and messages."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from ckpt_workers import train_and_save
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from zero_strategy.checkpoint.base.format import BUFFERS_KEY, PARAM_GROUPS_KEY, CheckpointError
from zero_strategy.checkpoint.dcp.cli import main as zero_to_dcp
from zero_strategy.checkpoint.dcp.export import export_to_dcp
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.testing import run_ranks

STEPS = 2


def _saved(tmp_path: Path, stage: int, world: int) -> Path:
    path = tmp_path / "ck"
    run_ranks(train_and_save, world, stage, STEPS, str(path), timeout_s=90)
    return path


def _torch_view(dcp_dir: Path, tmp_path: Path) -> dict:
    """The DCP checkpoint as torch itself reads it (no zero_strategy code involved)."""
    out = tmp_path / "via_torch.pt"
    dcp_to_torch_save(dcp_dir, out)
    return torch.load(out, weights_only=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_export_equals_consolidate_and_our_reader(tmp_path, stage, world):
    ckpt_dir = _saved(tmp_path, stage, world)
    out = tmp_path / "dcp"
    assert export_to_dcp(ckpt_dir, out) == out
    exported = _torch_view(out, tmp_path)

    consolidate(ckpt_dir, tmp_path / "full.pt", progress=False)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(exported["model"]) == set(full), "every key of the module's state_dict, tied ones included"
    for key, value in full.items():
        assert exported["model"][key].dtype == value.dtype and torch.equal(exported["model"][key], value), key

    with ShardedCheckpoint(ckpt_dir) as ckpt:
        trainer = ckpt.trainer_state()
        names = {p.name: (flat, p) for flat in ckpt.manifest.flat_params for p in flat.params}
        assert set(exported["optim"]["state"]) == set(names), "every optimized parameter, under its first name"
        for name, (flat, param) in names.items():
            state = exported["optim"]["state"][name]
            assert sorted(state) == sorted([*ckpt.state_names(flat), "step"])
            for state_name in ckpt.state_names(flat):
                ours = ckpt.read_param(name, f"optim:{state_name}")
                assert state[state_name].shape == tuple(param.shape)
                assert torch.equal(state[state_name].reshape(-1), ours), (name, state_name)
            assert state["step"].item() == ckpt.scalar_state_at(flat, param.offset)["step"]["value"] == STEPS
        [group] = exported["optim"]["param_groups"]
        assert sorted(group.pop("params")) == sorted(names)
        assert group == trainer[PARAM_GROUPS_KEY][0][0]
        expected_state = {k: v for k, v in trainer.items() if k not in (BUFFERS_KEY, PARAM_GROUPS_KEY)}
        got_state = torch.load(io.BytesIO(exported["zero_strategy"]["trainer_state"]), weights_only=True)
        assert got_state == expected_state
        assert set(exported["zero_strategy"]["rng"]) == {str(r) for r in range(world)}


@pytest.mark.timeout(120)
def test_chunks_are_the_ranks_slices(tmp_path):
    """No gathering: each stored chunk of a parameter lies inside one source rank's slice, and a parameter that
    spans ranks is stored as several chunks."""
    ckpt_dir = _saved(tmp_path, 3, 4)
    export_to_dcp(ckpt_dir, tmp_path / "dcp")
    metadata = FileSystemReader(tmp_path / "dcp").read_metadata()
    with ShardedCheckpoint(ckpt_dir) as ckpt:
        spanning = 0
        for flat in ckpt.manifest.flat_params:
            for param in flat.params:
                chunks = metadata.state_dict_metadata[f"model.{param.name}"].chunks
                ranks = set()
                for chunk in chunks:
                    first = param.offset + _flat_index(chunk.offsets, param.shape)
                    corner = [o + s - 1 for o, s in zip(chunk.offsets, chunk.sizes, strict=True)]
                    last = param.offset + _flat_index(corner, param.shape)
                    assert first // flat.shard_numel == last // flat.shard_numel, (param.name, chunk)
                    ranks.add(first // flat.shard_numel)
                assert len(chunks) <= len(ranks) * (2 * (len(param.shape) - 1) + 1)
                spanning += len(ranks) > 1
        assert spanning > 0, "the test model must have parameters split between ranks"


def _flat_index(index: list[int] | torch.Size, shape: list[int]) -> int:
    flat = 0
    for i, dim in zip(index, shape, strict=True):
        flat = flat * dim + i
    return flat


@pytest.mark.timeout(120)
def test_cli(tmp_path, capsys):
    ckpt_dir = _saved(tmp_path, 2, 2)
    out = tmp_path / "out"
    assert zero_to_dcp([str(ckpt_dir), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / ".metadata").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")], "the staging folder is renamed"

    assert zero_to_dcp([str(ckpt_dir), str(out)]) == 0, "an existing DCP checkpoint is replaced"
    assert len(list(out.glob("*.distcp"))) == 1, "the replaced checkpoint's data files are removed"
    assert zero_to_dcp([str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert zero_to_dcp([str(ckpt_dir), str(ckpt_dir)]) == 2
    err = capsys.readouterr().err
    assert "zero-to-dcp: error:" in err and "zero_strategy sharded checkpoint" in err and len(err.splitlines()) == 1
    (tmp_path / "file").write_text("x")
    assert zero_to_dcp([str(ckpt_dir), str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_hyper_parameter_objects_need_the_unsafe_flag(tmp_path, capsys):
    from ckpt_workers import INFO, build

    from zero_strategy.checkpoint.sharded.save import save_sharded

    _, _, engine = build(3)
    save_sharded(engine, tmp_path / "ck", {"hyper_parameters": {"opaque": Opaque()}}, INFO)
    assert zero_to_dcp([str(tmp_path / "ck"), str(tmp_path / "out")]) == 2
    assert "--unsafe-trainer-state" in capsys.readouterr().err
    assert zero_to_dcp([str(tmp_path / "ck"), str(tmp_path / "out"), "--unsafe-trainer-state"]) == 0
    with pytest.raises(CheckpointError):
        export_to_dcp(tmp_path / "ck", tmp_path / "again")
    assert not (tmp_path / "again").exists()


class Opaque:
    """A hyper-parameter object that ``weights_only=True`` refuses to unpickle."""
