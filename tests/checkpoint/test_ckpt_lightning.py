"""Lightning-level checkpoints: ZeRO Trainers saving through ModelCheckpoint, their ranks forked by run_ranks and
taken by Lightning for ranks torchrun started (helpers/launched.py): the fit runs in each forked rank.

Reference results come from the uninterrupted run of the same Trainer configuration; every resumed run starts
from a ``every_n_train_steps`` checkpoint at an epoch boundary (see tests/checkpoint/ckpt_models.py, [Note:
comparable layouts], and LIGHTNING.md on Lightning's own inexact mid-epoch resumes)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ckpt_models import LitNet, StartStepRecorder, every_n_steps, make_loader, top_k
from helpers.compare import max_abs_err
from helpers.launched import as_launched_rank
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.base.format import MANIFEST_NAME, TRAINER_STATE_NAME
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.testing import run_ranks

MAX_STEPS = 12
# Timeouts cover the module fixtures' fits too (whichever test runs first builds them) and leave room for a
# busy 2-core machine; a hung collective still fails first, on run_ranks' 30 s process-group timeout (gloo) or
# the strategy's 60 s one (shared-memory exchange).


def _fit_on_this_rank(
    root: Path,
    *,
    devices: int,
    stage: int = 3,
    ckpt_path: str | Path | None = None,
    dropout: float = 0.0,
    batch_norm: bool = True,
    scheduler_interval: str = "epoch",
    callbacks: Sequence[Callback] = (),
) -> dict[str, Tensor]:
    """Train a fresh LitNet (same initial weights every time) with a ZeRO Trainer on this rank of ``devices``;
    return the trained module's state_dict."""
    pl.seed_everything(0, verbose=False)
    model = LitNet(dropout=dropout, batch_norm=batch_norm, scheduler_interval=scheduler_interval)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=stage, process_group_timeout_s=60.0),
        accelerator="cpu",
        devices=devices,
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=list(callbacks),
        default_root_dir=root,
    )
    trainer.fit(model, make_loader(devices), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit_each(rank: int, world: int, fits: list[dict[str, Any]]) -> list[dict[str, Tensor]]:
    """On one rank of ``world`` (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK), the
    fits one after another, each given by the keyword arguments of :func:`_fit_on_this_rank`."""
    as_launched_rank(rank, world)
    return [_fit_on_this_rank(devices=world, **options) for options in fits]


def fit_in_turn(devices: int, *fits: dict[str, Any]) -> list[dict[str, Tensor]]:
    """The fits one after another on ``devices`` forked ranks; rank 0's trained state_dict of each."""
    return run_ranks(fit_each, devices, list(fits), timeout_s=90)[0]


def fit(root: Path, *, devices: int = 2, **options: Any) -> dict[str, Tensor]:
    """One fit on ``devices`` forked ranks (2 by default, stage 3 unless ``stage`` says otherwise)."""
    (final,) = fit_in_turn(devices, {"root": root, **options})
    return final


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory):
    """2 ranks, stage 3, dropout and BatchNorm: every 4th step kept in ``all/``, top-2 by loss + last in ``topk/``."""
    root = tmp_path_factory.mktemp("dropout")
    final = fit(root, dropout=0.3, callbacks=[every_n_steps(root / "all"), top_k(root / "topk")])
    return root, final


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """2 ranks, stage 3, no dropout, no BatchNorm (comparable across world sizes)."""
    root = tmp_path_factory.mktemp("plain")
    final = fit(root, batch_norm=False, callbacks=[every_n_steps(root / "all")])
    return root, final


def _max_abs_diff(got, ref) -> float:
    assert list(got) == list(ref), "keys or their order differ"
    return max_abs_err(got, ref)[0]


def _assert_identical(got, ref, what: str) -> None:
    assert list(got) == list(ref), f"{what}: keys or their order differ"
    for key, value in ref.items():
        assert got[key].dtype == value.dtype, f"{what}: {key} is {got[key].dtype}, expected {value.dtype}"
        assert torch.equal(got[key], value), f"{what}: {key} differs"


@pytest.mark.timeout(120)  # measured: 1 s (a 1- or 4-rank fit; the 2-rank fixture's when first)
@pytest.mark.parametrize(("devices", "stage"), [(1, 1), (4, 2)], ids=["2to1-zero3to1", "2to4-zero3to2"])
def test_resume_on_another_world_size(plain_run, tmp_path, devices, stage):
    root, final = plain_run
    record = tmp_path / "start_step.txt"
    resumed = fit(tmp_path, devices=devices, stage=stage, batch_norm=False, ckpt_path=root / "all" / "step=8.ckpt",
                  callbacks=[StartStepRecorder(record)])
    assert record.read_text() == "8", "the fit must resume from the checkpoint, not train from the start"
    err = _max_abs_diff(resumed, final)
    assert err <= 1e-6, f"2 ranks → {devices} (stage {stage}): weights off the uninterrupted run by {err:.2e}"


@pytest.mark.timeout(120)  # measured: under 1 s (the 2-rank fixture's fit when first)
@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".bin", ".ckpt"])
def test_consolidated_output_equals_trained_state_dict(dropout_run, tmp_path, suffix):
    root, final = dropout_run
    out = consolidate(root / "all" / "step=12.ckpt", tmp_path / f"model{suffix}", progress=False)
    if suffix == ".safetensors":
        got = load_file(out)
    elif suffix == ".ckpt":
        checkpoint = torch.load(out, weights_only=True)
        assert checkpoint["global_step"] == MAX_STEPS and "loops" in checkpoint
        assert "optimizer_states" not in checkpoint and "lr_schedulers" not in checkpoint
        module = LitNet.load_from_checkpoint(out)
        assert module.hparams.dropout == 0.3 and module.proj.weight is module.inp.weight
        got = module.state_dict()
    else:
        got = torch.load(out, weights_only=True)
        # tied weights come back as one tensor under both keys, as from the module itself
        assert got["proj.weight"].untyped_storage().data_ptr() == got["inp.weight"].untyped_storage().data_ptr()
    _assert_identical(got, final, f"consolidated {suffix}")
    assert torch.equal(got["proj.weight"], got["inp.weight"])
    assert "norm.running_mean" in got and got["norm.num_batches_tracked"].dtype == torch.int64


@pytest.mark.timeout(120)  # measured: under 1 s (the 2-rank fixture's fit when first)
def test_files_load_with_safetensors_and_weights_only_torch(dropout_run):
    root, _ = dropout_run
    path = root / "all" / "step=12.ckpt"
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    version_dir = path / manifest["version_dir"]
    for rank in range(manifest["world_size"]):
        with safe_open(str(version_dir / f"shard-{rank:05d}.safetensors"), framework="pt") as shard:
            names = list(shard.keys())
            assert any(n.startswith("flat/") for n in names) and any(n.startswith("optim/") for n in names)
            for name in names:
                assert shard.get_tensor(name).numel() > 0
            assert shard.metadata()["rank"] == str(rank)
    state = torch.load(version_dir / TRAINER_STATE_NAME, weights_only=True)
    assert state["global_step"] == MAX_STEPS and state["hyper_parameters"]["dropout"] == 0.3
    assert {"loops", "callbacks", "lr_schedulers", "pytorch-lightning_version"} <= set(state)


def _best_k_paths(path) -> set[str]:
    with ShardedCheckpoint(path) as ckpt:
        callbacks = ckpt.trainer_state()["callbacks"]
    (state,) = [s for k, s in callbacks.items() if "'monitor': 'train_loss'" in k]
    return {os.path.basename(p) for p in state["best_k_models"]}


@pytest.mark.timeout(120)  # measured: under 1 s (the 2-rank fixture's fit when first)
def test_top_k_keeps_k_directories_plus_last(dropout_run):
    root, _ = dropout_run
    topk = root / "topk"
    kept = sorted(p.name for p in topk.iterdir())
    # saved every 2 steps (6 checkpoints): only the 2 best by loss remain, plus last; no staging leftovers
    assert len(kept) == 3 and "last.ckpt" in kept, kept
    assert set(kept) - {"last.ckpt"} == _best_k_paths(topk / "last.ckpt")
    assert all((topk / name / MANIFEST_NAME).is_file() for name in kept)
    # last.ckpt was overwritten in place at every save: one version inside, and it is the step-12 state
    assert len(list((topk / "last.ckpt").glob("v-*"))) == 1
    with ShardedCheckpoint(topk / "last.ckpt") as ckpt:
        assert ckpt.trainer_state()["global_step"] == MAX_STEPS
    # ... and its modification time moved with it (Lightning's "last" lookup goes by mtime)
    assert (topk / "last.ckpt").stat().st_mtime >= (root / "all" / "step=12.ckpt").stat().st_mtime


@pytest.mark.timeout(120)  # measured: under 1 s (a 2-rank fit; the fixture's when first)
def test_resume_from_last_is_bit_identical_with_dropout(dropout_run, tmp_path):
    """``ckpt_path="last"`` picks the newest of ``last*.ckpt`` (here the step-8 checkpoint, beside an older
    step-4 ``last-v1.ckpt``), and the resumed run ends bit-identical to the uninterrupted one: dropout masks
    and data order continue exactly (each rank's RNG is restored)."""
    root, final = dropout_run
    resume_dir = tmp_path / "ckpts"
    resume_dir.mkdir()
    shutil.copytree(root / "all" / "step=8.ckpt", resume_dir / "last.ckpt")
    shutil.copytree(root / "all" / "step=4.ckpt", resume_dir / "last-v1.ckpt")
    now = time.time()
    os.utime(resume_dir / "last-v1.ckpt", (now - 3600, now - 3600))
    os.utime(resume_dir / "last.ckpt", (now, now))
    record = tmp_path / "start_step.txt"
    resumed = fit(tmp_path, dropout=0.3, ckpt_path="last", callbacks=[top_k(resume_dir), StartStepRecorder(record)])
    assert record.read_text() == "8"
    _assert_identical(resumed, final, "resumed from last (step 8) vs uninterrupted")
    with ShardedCheckpoint(resume_dir / "last.ckpt") as ckpt:
        at_save = ckpt.read_param("blocks.0.0.weight").view_as(final["blocks.0.0.weight"])
    assert not torch.equal(at_save, final["blocks.0.0.weight"]), "the resumed run must have trained"


@pytest.mark.timeout(120)  # measured: 3 s (two 1-rank fits)
def test_resume_with_step_interval_scheduler(tmp_path):
    all_steps = tmp_path / "full" / "all"
    options = {"stage": 1, "scheduler_interval": "step"}
    final, resumed = fit_in_turn(  # one rank, both fits in one launch
        1,
        {"root": tmp_path / "full", "callbacks": [every_n_steps(all_steps)], **options},
        {"root": tmp_path / "resumed", "ckpt_path": all_steps / "step=8.ckpt",
         "callbacks": [StartStepRecorder(tmp_path / "start_step.txt")], **options},
    )
    assert (tmp_path / "start_step.txt").read_text() == "8", "the second fit must resume, not train from the start"
    _assert_identical(resumed, final, "step-interval scheduler, resumed at step 8 vs uninterrupted")
