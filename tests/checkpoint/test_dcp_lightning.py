"""``ZeroStrategy(checkpoint_format="dcp")`` in a Trainer: ``ModelCheckpoint`` writes torch.distributed.checkpoint
directories, which equal the offline export of our own format saved at the same step, and
``trainer.fit(ckpt_path=<DCP dir>)`` resumes exactly where the uninterrupted run goes (dropout and BatchNorm on:
RNG state and buffers travel through the DCP checkpoint).

Two 2-rank fits in all, one after the other in one launch: the uninterrupted one (which also saves our own format
once, at the step ModelCheckpoint writes DCP), and the resumed one. The ranks are forked by run_ranks and taken by
Lightning for ranks torchrun started (helpers/launched.py): each fit runs in the forked ranks."""

from __future__ import annotations

import io
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from ckpt_models import LitNet, StartStepRecorder, every_n_steps, make_loader
from helpers.launched import as_launched_rank
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.dcp.export import export_to_dcp
from zero_strategy.config import CheckpointFormat
from zero_strategy.testing import run_ranks

MAX_STEPS, SAVE_AT = 8, 4


class AlsoSaveOurFormat(Callback):
    """At step SAVE_AT, write our own format too (the strategy's format switched for this one save)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == SAVE_AT:
            io_plugin = trainer.strategy.checkpoint_io
            io_plugin.checkpoint_format = CheckpointFormat.zero
            try:
                trainer.save_checkpoint(self.path)
            finally:
                io_plugin.checkpoint_format = CheckpointFormat.dcp


def _fit(root: Path, callbacks: list[Callback], ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    model = LitNet(dropout=0.3, batch_norm=True)
    strategy = ZeroStrategy(stage=3, process_group_timeout_s=60.0, checkpoint_format="dcp")
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )
    trainer.fit(model, make_loader(2), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit_then_resume(rank: int, world: int, root: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK): the uninterrupted
    fit, saving DCP at step SAVE_AT and our own format beside it, then the fit resumed from that DCP checkpoint."""
    as_launched_rank(rank, world)
    tmp_path = Path(root)
    final = _fit(tmp_path / "run", [every_n_steps(tmp_path / "all", SAVE_AT), AlsoSaveOurFormat(tmp_path / "ours")])
    resumed = _fit(tmp_path / "resumed", [StartStepRecorder(tmp_path / "start_step.txt")],
                   ckpt_path=tmp_path / "all" / f"step={SAVE_AT}.ckpt")
    return final, resumed


def _torch_view(path: Path, out: Path) -> dict:
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


@pytest.mark.timeout(120)  # measured: 1 s (both fits)
def test_modelcheckpoint_writes_dcp_that_equals_the_export_and_resumes_exactly(tmp_path):
    final, resumed = run_ranks(fit_then_resume, 2, str(tmp_path), timeout_s=90)[0]  # rank 0's trained state_dicts
    online = tmp_path / "all" / f"step={SAVE_AT}.ckpt"
    assert (online / ".metadata").is_file() and not (online / "manifest.json").exists()
    export_to_dcp(tmp_path / "ours", tmp_path / "exported")

    got, ref = _torch_view(online, tmp_path / "online.pt"), _torch_view(tmp_path / "exported", tmp_path / "ex.pt")
    assert set(got["model"]) == set(ref["model"]) == set(final), "every state_dict key, BatchNorm buffers too"
    for section in ("model", "optim"):
        flat_got, flat_ref = _flatten(got[section]), _flatten(ref[section])
        assert flat_got.keys() == flat_ref.keys(), section
        for key, value in flat_ref.items():
            same = torch.equal(flat_got[key], value) if isinstance(value, torch.Tensor) else flat_got[key] == value
            assert same, (section, key)
    assert got["zero_strategy"]["rng"] == ref["zero_strategy"]["rng"], "each rank's RNG state at that step"
    state = torch.load(io.BytesIO(got["zero_strategy"]["trainer_state"]), weights_only=True)
    assert state["global_step"] == SAVE_AT and "loops" in state and "lr_schedulers" in state

    assert (tmp_path / "start_step.txt").read_text() == str(SAVE_AT), "the second fit must resume from the DCP save"
    assert list(resumed) == list(final)
    for key, value in final.items():
        assert torch.equal(resumed[key], value), f"{key}: resumed from DCP differs from the uninterrupted run"


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _flatten(sub, f"{prefix}{i}.").items()}
    return {prefix: tree}
