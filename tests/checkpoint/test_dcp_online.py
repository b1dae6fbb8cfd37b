"""``checkpoint_format="dcp"`` at the engine level (``save_dcp``): every rank writes the boxes of its own slices
through DCP's collective save. What torch reads from it equals the offline export of our own format saved at the
same moment — every tensor, hyper-parameter, trainer state and RNG record — for flat and hybrid layouts; a save
over an existing DCP checkpoint replaces it in place and leaves only its own files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_workers import INFO, build, trainer_state
from dcp_workers import zero_save_then_train
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.dcp.export import export_to_dcp
from zero_strategy.testing import run_ranks


def _torch_view(dcp_dir: Path, out: Path) -> dict:
    dcp_to_torch_save(dcp_dir, out)
    return torch.load(out, weights_only=False)


def _assert_identical(got: Any, ref: Any, path: tuple = ()) -> None:
    assert type(got) is type(ref), (path, type(got), type(ref))
    if isinstance(ref, dict):
        assert list(got) == list(ref) or set(got) == set(ref), (path, sorted(set(got) ^ set(ref)))
        for key in ref:
            _assert_identical(got[key], ref[key], (*path, key))
    elif isinstance(ref, list | tuple):
        assert len(got) == len(ref), path
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            _assert_identical(a, b, (*path, i))
    elif isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref), path
    else:
        assert got == ref, path


LAYOUTS = {
    "zero3-2ranks": (3, 2, None),
    "zero1-4ranks": (1, 4, None),
    "zero2-hybrid-2x2": (2, 4, {"shard_group_size": 2}),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_online_save_equals_the_offline_export(tmp_path, layout):
    stage, world, extra = LAYOUTS[layout]
    run_ranks(zero_save_then_train, world, stage, str(tmp_path / "zero"), str(tmp_path / "online"), extra, timeout_s=90)
    export_to_dcp(tmp_path / "zero", tmp_path / "offline")
    online = _torch_view(tmp_path / "online", tmp_path / "online.pt")
    offline = _torch_view(tmp_path / "offline", tmp_path / "offline.pt")
    _assert_identical(online, offline)
    assert set(online) == {"model", "optim", "zero_strategy"}
    files = sorted(p.name for p in (tmp_path / "online").iterdir())
    writers = world if extra is None else world // extra["shard_group_size"]  # replicas write nothing
    assert len([f for f in files if f.endswith(".distcp")]) == writers, files


def _save_twice(rank, world, path):
    from zero_strategy.checkpoint.dcp.save import save_dcp

    _, _, engine = build(3)
    save_dcp(engine, path, trainer_state(0), INFO)
    first = sorted(p.name for p in Path(path).iterdir())
    with torch.no_grad():
        for flat in engine.flat_params:
            flat.shard.add_(1.0)
    save_dcp(engine, path, trainer_state(0), INFO)
    return first


@pytest.mark.timeout(90)
def test_a_save_over_a_dcp_checkpoint_replaces_it_in_place(tmp_path):
    path = tmp_path / "last.ckpt"
    first_files = run_ranks(_save_twice, 2, str(path), timeout_s=60)[0]
    second_files = sorted(p.name for p in path.iterdir())
    data = [name for name in second_files if name.endswith(".distcp")]
    assert len(data) == 2 and not set(data) & set(first_files), (first_files, second_files)
    assert second_files == sorted([".metadata", *data]), "no scratch folder or earlier file stays behind"
    assert {info.relative_path for info in FileSystemReader(path).read_metadata().storage_data.values()} == set(data)
    assert not [p for p in tmp_path.iterdir() if p.name != "last.ckpt"], "no staging folder stays behind"


def _save_to(rank, world, path):
    from zero_strategy.checkpoint.dcp.save import save_dcp

    _, _, engine = build(3)
    try:
        save_dcp(engine, path, trainer_state(0), INFO)
    except CheckpointError as error:
        return str(error)
    return None


@pytest.mark.timeout(90)
def test_targets_it_must_not_overwrite_are_refused_on_every_rank(tmp_path):
    from ckpt_workers import train_and_save

    run_ranks(train_and_save, 2, 3, 1, str(tmp_path / "ours"), timeout_s=60)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me")
    for target, message in [("ours", "zero_strategy sharded checkpoint"), ("full", "not empty"), ("file", "a file")]:
        errors = run_ranks(_save_to, 2, str(tmp_path / target), timeout_s=60)
        assert all(error is not None and message in error for error in errors), errors
    assert (tmp_path / "full" / "x.txt").read_text() == (tmp_path / "file").read_text() == "keep me"
