"""A rank that dies during a save leaves the previous checkpoint at that path complete, unchanged and loadable;
the survivors fail quickly (short process-group timeout) instead of hanging; whatever the dead save left behind is
never what Lightning's ``ckpt_path="last"`` lookup (``last*.ckpt``, newest by modification time) resumes from."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from ckpt_workers import INFO, build, train_and_save, train_steps, trainer_state
from helpers.models import make_batches
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from zero_strategy.checkpoint.base.format import MANIFEST_NAME
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.testing import RankFailed, run_ranks

PG_TIMEOUT_S = 5.0


def _crash_in_shard_write(save_module, format_module) -> None:
    """This rank dies after its shard file's header and first tensor are on disk."""
    real = save_module.write_safetensors

    def dying_write(path, specs, tensors, metadata):
        def tensors_then_die():
            iterator = iter(tensors)
            yield next(iterator)
            os._exit(1)

        return real(path, specs, tensors_then_die(), metadata)

    save_module.write_safetensors = dying_write


def _crash_before_manifest(save_module, format_module) -> None:
    """Rank 0 dies after every shard and the trainer state are written, before the manifest."""

    def die(self, directory):
        os._exit(1)

    format_module.Manifest.write_atomically = die


def _crash_before_manifest_rename(save_module, format_module) -> None:
    """Rank 0 dies with the new manifest fully written to its temporary name, just before the rename that
    would publish it."""
    real_replace = os.replace

    def dying_replace(src, dst, *args, **kwargs):
        if Path(dst).name == MANIFEST_NAME:
            os._exit(1)
        return real_replace(src, dst, *args, **kwargs)

    format_module.os.replace = dying_replace


CRASHES = {
    "rank1-in-shard-write": (1, _crash_in_shard_write),
    "rank0-in-shard-write": (0, _crash_in_shard_write),
    "rank0-before-manifest": (0, _crash_before_manifest),
    "rank0-before-manifest-rename": (0, _crash_before_manifest_rename),
}


SAVE_RETURNED = "the save returned on the surviving rank"


def _train_and_crash_while_saving(rank, world, path, crash):
    import zero_strategy.checkpoint.base.format as format_module
    import zero_strategy.checkpoint.sharded.save as save_module
    from zero_strategy.checkpoint.sharded.save import save_sharded

    crash_rank, inject = CRASHES[crash]
    model, optimizer, engine = build(3)
    train_steps(model, optimizer, engine, make_batches(4, 1, 8, seed=5))  # other weights than the saved ones
    if rank == crash_rank:
        inject(save_module, format_module)
    save_sharded(engine, path, trainer_state(4), INFO)
    # every crash here kills a rank before the checkpoint is published: a save that returns on the survivor made a
    # failed save look done (what follows a save, e.g. a stage-3 gather, would fail too, but later and elsewhere)
    raise RuntimeError(SAVE_RETURNED)


def _save(rank, world, path):
    from zero_strategy.checkpoint.sharded.save import save_sharded

    _model, _optimizer, engine = build(3)
    save_sharded(engine, path, trainer_state(0), INFO)


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _lightning_last(dirpath: Path) -> str | None:
    """What ``trainer.fit(ckpt_path="last")`` would resume from, by Lightning's own lookup."""
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=dirpath)],
    )
    return trainer._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, "last", model_provided=True, model_connected=True
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite-last", "new-last-v1"])
@pytest.mark.parametrize("crash", list(CRASHES))
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, crash, overwrite):
    last = tmp_path / "last.ckpt"
    expected = run_ranks(train_and_save, 2, 3, 2, str(last), timeout_s=60)[0]
    before = _files(last)
    target = last if overwrite else tmp_path / "last-v1.ckpt"

    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        # the harness reports the crash at once; the grace lets it also report what the survivor did
        run_ranks(_train_and_crash_while_saving, 2, str(target), crash, timeout_s=45, pg_timeout_s=PG_TIMEOUT_S,
                  survivors_grace_s=PG_TIMEOUT_S + 15)  # fmt: skip
    elapsed = time.monotonic() - start
    crash_rank = CRASHES[crash][0]
    assert str(failed.value).startswith(f"rank {crash_rank} crashed: exited with code 1"), str(failed.value)[-2000:]
    # the survivor raised (it did not hang until the harness gave up), within the process-group timeout
    assert f"rank {1 - crash_rank} raised" in str(failed.value), str(failed.value)[-2000:]
    assert SAVE_RETURNED not in str(failed.value), str(failed.value)[-2000:]  # it raised inside the save
    assert elapsed < PG_TIMEOUT_S + 20, f"the surviving rank took {elapsed:.1f} s to fail"

    # the previous checkpoint: same files, same bytes (the dead save's new version directory and temporary
    # manifest may sit beside them; the manifest does not point at them)
    after = _files(last)
    assert {name: after[name] for name in before} == before
    old_dirs = {name.split("/")[0] for name in before}
    leftovers = sorted(set(after) - set(before))
    assert all(
        name == f".{MANIFEST_NAME}.tmp" or (name.startswith("v-") and name.split("/")[0] not in old_dirs)
        for name in leftovers
    ), leftovers
    # ... and it loads, with the weights it was saved with
    with ShardedCheckpoint(last) as ckpt:
        for key, kind, name in ckpt.manifest.state_dict_keys:
            assert kind == "param"
            assert torch.equal(ckpt.read_param(name).view_as(expected[key]), expected[key]), key
    if not overwrite:
        assert not target.exists(), "a save that did not finish must not appear under its final name"
        assert any(p.name.startswith(".last-v1.ckpt.partial-") for p in tmp_path.iterdir()), (
            "expected the dead save's staging directory (otherwise this case tests nothing)"
        )
    assert Path(_lightning_last(tmp_path)) == last


@pytest.mark.timeout(60)
def test_next_save_after_a_crash_cleans_up_and_publishes(tmp_path):
    """After a save died inside an existing checkpoint, the next save to that path succeeds and leaves a single
    version directory."""
    last = tmp_path / "last.ckpt"
    run_ranks(train_and_save, 2, 3, 2, str(last), timeout_s=60)
    with pytest.raises(RankFailed):
        run_ranks(
            _train_and_crash_while_saving, 2, str(last), "rank1-in-shard-write", timeout_s=45, pg_timeout_s=PG_TIMEOUT_S
        )
    assert len(list(last.glob("v-*"))) == 2
    run_ranks(_save, 2, str(last), timeout_s=60)
    assert len(list(last.glob("v-*"))) == 1
    with ShardedCheckpoint(last) as ckpt:
        assert (last / ckpt.manifest.version_dir).is_dir()


@pytest.mark.timeout(60)
def test_overwrite_makes_the_checkpoint_newest(tmp_path):
    """Overwriting ``last.ckpt`` in place must make it newer than an older ``last-v1.ckpt``: Lightning picks
    ``last*`` by the directory's modification time, which writing files inside it does not change."""
    last, older = tmp_path / "last.ckpt", tmp_path / "last-v1.ckpt"
    run_ranks(_save, 2, str(last), timeout_s=60)
    run_ranks(_save, 2, str(older), timeout_s=60)
    past = time.time() - 3600
    os.utime(last, (past, past))
    os.utime(older, (past + 60, past + 60))
    assert Path(_lightning_last(tmp_path)) == older
    run_ranks(_save, 2, str(last), timeout_s=60)
    assert Path(_lightning_last(tmp_path)) == last
