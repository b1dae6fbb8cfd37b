"""``checkpoint_format="dcp"`` is as crash-safe as our own format: a rank that dies at any point of a DCP save
leaves the previous checkpoint at that path byte-for-byte unchanged and loadable by torch's own reader, the
survivors fail within the process-group timeout instead of hanging, a new checkpoint never appears under its
final name half-written, and the next save to the path succeeds and removes what the dead one left."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from ckpt_workers import INFO, build, full_state, train_steps, trainer_state
from helpers.models import make_batches
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from zero_strategy.testing import RankFailed, run_ranks

PG_TIMEOUT_S = 5.0


def _die_in_second_box(storage, planner) -> None:
    """This rank dies inside its data file: the first item is on disk, the second is being produced."""
    real = planner.ChunkedSavePlanner.resolve_data
    calls = []

    def dying(self, write_item):
        calls.append(write_item)
        if len(calls) == 2:
            os._exit(1)
        return real(self, write_item)

    planner.ChunkedSavePlanner.resolve_data = dying


def _die_before_metadata_replace(storage, planner) -> None:
    """Rank 0 (DCP's coordinator) dies with the new ``.metadata`` complete in its scratch folder."""
    real = os.replace

    def dying(src, dst, *args, **kwargs):
        if Path(dst).name == ".metadata":
            os._exit(1)
        return real(src, dst, *args, **kwargs)

    storage.os.replace = dying


def _die_before_rename(storage, planner) -> None:
    """Rank 0 dies after the whole new checkpoint is written, before it is renamed to its name."""

    def dying(src, dst, *args, **kwargs):
        os._exit(1)

    storage.os.rename = dying


CRASHES = {
    "rank1-in-data-file": (1, _die_in_second_box),
    "rank0-in-data-file": (0, _die_in_second_box),
    "rank0-before-metadata-replace": (0, _die_before_metadata_replace),
    "rank0-before-rename": (0, _die_before_rename),
}


def _train_and_save(rank, world, path):
    from zero_strategy.checkpoint.dcp.save import save_dcp

    model, optimizer, engine = build(3)
    train_steps(model, optimizer, engine, make_batches(2, 1, 8))
    save_dcp(engine, path, trainer_state(2), INFO)
    return full_state(model, engine)


def _train_and_crash_while_saving(rank, world, path, crash):
    import zero_strategy.checkpoint.dcp.planner as planner
    import zero_strategy.checkpoint.dcp.storage as storage
    from zero_strategy.checkpoint.dcp.save import save_dcp

    crash_rank, inject = CRASHES[crash]
    model, optimizer, engine = build(3)
    train_steps(model, optimizer, engine, make_batches(4, 1, 8, seed=5))  # other weights than the saved ones
    if rank == crash_rank:
        inject(storage, planner)
    save_dcp(engine, path, trainer_state(4), INFO)


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _lightning_last(dirpath: Path) -> str | None:
    """What ``trainer.fit(ckpt_path="last")`` would resume from, by Lightning's own lookup."""
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[ModelCheckpoint(dirpath=dirpath)])
    return trainer._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, "last", model_provided=True, model_connected=True
    )


# an in-place update (overwrite) publishes by replacing .metadata, never by a rename: no rename case for it
CASES = [(crash, True) for crash in CRASHES if crash != "rank0-before-rename"] + [(crash, False) for crash in CRASHES]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("crash", "overwrite"), CASES, ids=[f"{c}-{'overwrite-last' if o else 'new-last-v1'}" for c, o in CASES]
)
def test_crash_during_a_dcp_save_keeps_the_previous_checkpoint(tmp_path, crash, overwrite):
    last = tmp_path / "last.ckpt"
    expected = run_ranks(_train_and_save, 2, str(last), timeout_s=60)[0]
    before = _files(last)
    target = last if overwrite else tmp_path / "last-v1.ckpt"

    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        # the survivor is given time to see its peer die (the process group's timeout): it must raise, not hang
        run_ranks(_train_and_crash_while_saving, 2, str(target), crash, timeout_s=60, pg_timeout_s=PG_TIMEOUT_S,
                  survivors_grace_s=PG_TIMEOUT_S + 15)  # fmt: skip
    assert "crashed" in str(failed.value) and "raised" in str(failed.value), str(failed.value)[-2000:]
    assert time.monotonic() - start < PG_TIMEOUT_S + 25, "the surviving rank must fail, not hang"

    after = _files(last)
    assert {name: after[name] for name in before} == before, "the previous checkpoint's files are untouched"
    leftovers = sorted(set(after) - set(before))
    assert all(name.endswith(".distcp") or name.startswith(".metadata-") for name in leftovers), leftovers
    dcp_to_torch_save(last, tmp_path / "previous.pt")
    model = torch.load(tmp_path / "previous.pt", weights_only=False)["model"]
    for key, value in expected.items():
        assert torch.equal(model[key], value), key
    if not overwrite:
        assert not target.exists(), "a save that did not finish must not appear under its final name"
        if crash.startswith("rank0"):
            assert any(p.name.startswith(".last-v1.ckpt.partial-") for p in tmp_path.iterdir()), (
                "expected the dead save's staging directory (otherwise this case tests nothing)"
            )
    assert Path(_lightning_last(tmp_path)) == last


@pytest.mark.timeout(120)
def test_the_next_save_after_a_crash_publishes_and_cleans_up(tmp_path):
    last = tmp_path / "last.ckpt"
    run_ranks(_train_and_save, 2, str(last), timeout_s=60)
    with pytest.raises(RankFailed):
        run_ranks(
            _train_and_crash_while_saving, 2, str(last), "rank0-before-metadata-replace", timeout_s=60,
            pg_timeout_s=PG_TIMEOUT_S,
        )  # fmt: skip
    assert len(list(last.glob("*.distcp"))) == 4 and list(last.glob(".metadata-*")), "the dead save's files"
    expected = run_ranks(_train_and_save, 2, str(last), timeout_s=60)[0]
    assert sorted(p.name for p in last.iterdir() if not p.name.endswith(".distcp")) == [".metadata"]
    assert len(list(last.glob("*.distcp"))) == 2
    dcp_to_torch_save(last, tmp_path / "now.pt")
    model = torch.load(tmp_path / "now.pt", weights_only=False)["model"]
    assert all(torch.equal(model[key], value) for key, value in expected.items())
