"""Damaged, incomplete or mismatched checkpoints fail with a CheckpointError naming the file (or parameter) before
anything is changed: the model's weights and the optimizer's state are exactly what they were. The consolidation
CLI reports the same problems as one line and exit status 2, and leaves no output behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_workers import build, full_state, load_into, train_and_save, train_steps
from helpers.models import make_batches

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, TRAINER_STATE_NAME, CheckpointError
from zero_strategy.checkpoint.export.cli import main as zero_to_fp32
from zero_strategy.testing import run_ranks


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three 2-rank stage-3 checkpoints: the one to damage, another of the same model, one of a wider model."""
    root = tmp_path_factory.mktemp("damage-src")
    good, other, wider = root / "good", root / "other", root / "wider"
    expected = run_ranks(train_and_save, 2, 3, 2, str(good), timeout_s=60)[0]
    run_ranks(train_and_save, 2, 3, 3, str(other), 7, timeout_s=60)
    run_ranks(_train_and_save_wider, 2, 3, str(wider), timeout_s=60)
    return {"good": good, "other": other, "wider": wider, "expected": expected}


def _train_and_save_wider(rank, world, stage, path):
    from ckpt_workers import INFO, trainer_state

    from zero_strategy.checkpoint.sharded.save import save_sharded

    _, _, engine = build(stage, width=13)
    save_sharded(engine, path, trainer_state(0), INFO)


def _version_dir(path: Path) -> Path:
    return path / json.loads((path / MANIFEST_NAME).read_text())["version_dir"]


def _edit_manifest(path: Path, **changes) -> None:
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest.update(changes)
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def _truncate(file: Path) -> None:
    with open(file, "r+b") as handle:
        handle.truncate(file.stat().st_size // 2)


def delete_shard(ck, src):
    (_version_dir(ck) / "shard-00001.safetensors").unlink()
    return "shard-00001.safetensors"


def truncate_shard(ck, src):
    _truncate(_version_dir(ck) / "shard-00000.safetensors")
    return "shard-00000.safetensors"


def truncate_shard_and_manifest_size(ck, src):
    """The recorded size agrees with the cut file: the header's own offsets must catch it."""
    shard = _version_dir(ck) / "shard-00001.safetensors"
    _truncate(shard)
    sizes = json.loads((ck / MANIFEST_NAME).read_text())["shard_bytes"]
    _edit_manifest(ck, shard_bytes=[sizes[0], shard.stat().st_size])
    return "shard-00001.safetensors"


def replace_shard_from_other_checkpoint(ck, src):
    shutil.copyfile(
        _version_dir(src["other"]) / "shard-00001.safetensors", _version_dir(ck) / "shard-00001.safetensors"
    )
    return "shard-00001.safetensors"


def foreign_shard_with_matching_size(ck, src):
    """A shard of another checkpoint, with the manifest's recorded size adjusted: only its id can tell."""
    shard = _version_dir(ck) / "shard-00001.safetensors"
    shutil.copyfile(_version_dir(src["other"]) / shard.name, shard)
    sizes = json.loads((ck / MANIFEST_NAME).read_text())["shard_bytes"]
    _edit_manifest(ck, shard_bytes=[sizes[0], shard.stat().st_size])
    return "foreign"


def swapped_ranks(ck, src):
    version = _version_dir(ck)
    a, b = version / "shard-00000.safetensors", version / "shard-00001.safetensors"
    a.rename(version / "tmp")
    b.rename(a)
    (version / "tmp").rename(b)
    _edit_manifest(ck, shard_bytes=[a.stat().st_size, b.stat().st_size])
    return "shard-00000.safetensors"


def newer_format_version(ck, src):
    _edit_manifest(ck, format_version=99)
    return MANIFEST_NAME


def _edit_params(ck: Path, change) -> str:
    """Apply ``change`` to the params of the first FlatParam holding two or more; return what the error must name."""
    manifest = json.loads((ck / MANIFEST_NAME).read_text())
    flat = next(f for f in manifest["flat_params"] if len(f["params"]) >= 2)
    named = change(flat, len(manifest["shard_bytes"]))
    (ck / MANIFEST_NAME).write_text(json.dumps(manifest))
    return named


def parameter_range_past_its_shards(ck, src):
    """The last parameter recorded one element later than its shards hold it (a writer's off-by-one)."""
    def shift_last(flat, world):
        last = max(flat["params"], key=lambda p: p["offset"])
        last["offset"] = flat["shard_numel"] * world - last["numel"] + 1
        return last["name"]
    return _edit_params(ck, shift_last)


def overlapping_parameter_ranges(ck, src):
    """Two parameters recorded over the same elements."""
    def overlap(flat, world):
        first, second = sorted(flat["params"], key=lambda p: p["offset"])[:2]
        second["offset"] = first["offset"] + first["numel"] - 1
        return second["name"]
    return _edit_params(ck, overlap)


def missing_manifest(ck, src):
    (ck / MANIFEST_NAME).unlink()
    return MANIFEST_NAME


def truncated_trainer_state(ck, src):
    _truncate(_version_dir(ck) / TRAINER_STATE_NAME)
    return TRAINER_STATE_NAME


DAMAGES = [
    delete_shard,
    truncate_shard,
    truncate_shard_and_manifest_size,
    replace_shard_from_other_checkpoint,
    foreign_shard_with_matching_size,
    swapped_ranks,
    newer_format_version,
    parameter_range_past_its_shards,
    overlapping_parameter_ranges,
    missing_manifest,
    truncated_trainer_state,
]


def _snapshot(model, optimizer, engine):
    state = {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in optimizer.state.items()}
    return full_state(model, engine), state


def _assert_unchanged(before, model, optimizer, engine):
    weights, opt_state = before
    after_weights, after_state = _snapshot(model, optimizer, engine)
    for key, value in weights.items():
        assert torch.equal(after_weights[key], value), f"{key} changed by a failed load"
    assert after_state.keys() == opt_state.keys()
    for piece, values in opt_state.items():
        for name, value in values.items():
            assert torch.equal(after_state[piece][name], value), f"optimizer state {name} changed by a failed load"


def _trained_engine():
    """A one-rank stage-3 engine one step into training (so it has optimizer state to lose)."""
    model, optimizer, engine = build(3)
    train_steps(model, optimizer, engine, make_batches(1, 1, 8, seed=99))
    return model, optimizer, engine


@pytest.mark.timeout(60)
def test_undamaged_copy_loads(sources, tmp_path):
    """Control: the same procedure on an intact copy does change the model (to the checkpoint's weights)."""
    ck = tmp_path / "ck"
    shutil.copytree(sources["good"], ck)
    model, _optimizer, engine = _trained_engine()
    before = full_state(model, engine)
    load_into(engine, ck)
    after = full_state(model, engine)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for key, value in sources["expected"].items():
        assert torch.equal(after[key], value), key


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_damaged_checkpoint_is_refused_before_any_change(sources, tmp_path, damage):
    ck = tmp_path / "ck"
    shutil.copytree(sources["good"], ck)
    named = damage(ck, sources)
    model, optimizer, engine = _trained_engine()
    before = _snapshot(model, optimizer, engine)
    with pytest.raises(CheckpointError, match=named):
        load_into(engine, ck)
    _assert_unchanged(before, model, optimizer, engine)


@pytest.mark.timeout(60)
def test_checkpoint_of_another_model_names_the_parameter(sources):
    model, optimizer, engine = _trained_engine()
    before = _snapshot(model, optimizer, engine)
    with pytest.raises(CheckpointError, match=r"shape mismatch.*emb\.weight") as info:
        load_into(engine, sources["wider"])
    assert str(sources["wider"]) in str(info.value)
    _assert_unchanged(before, model, optimizer, engine)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_cli_reports_damage_in_one_line_with_exit_2(sources, tmp_path, damage, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(sources["good"], ck)
    named = damage(ck, sources)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert zero_to_fp32([str(ck), str(out_dir / "model.safetensors"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero-to-fp32: error: ") and err.count("\n") == 1, err
    assert named in err
    assert list(out_dir.iterdir()) == [], "a failed consolidation must leave no file (nor temporary file)"
