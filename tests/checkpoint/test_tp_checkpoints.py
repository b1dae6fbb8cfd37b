"""Checkpoints of tensor-parallel runs (issue 36): ``ZeroStrategy(stage=s, tensor_parallel_size=2)`` on 4 ranks (2 DP x
2 TP) saves through ModelCheckpoint; the checkpoint resumes at DP 1 (2 ranks) and DP 4 (8 ranks), at TP 4 (8
ranks) and in a run without tensor parallelism (and a checkpoint saved without it resumes at TP 2), equal to the
uninterrupted run and to a single-process reference;
a failed save leaves the previous checkpoint as it was; a checkpoint of another model is refused by name;
``zero-to-fp32`` writes the whole model.

Layouts are comparable (see [Note: comparable layouts] in tests/checkpoint/ckpt_models.py): 8 samples, a global
batch of 4 split over the data-parallel ranks, so an epoch is 2 steps at every DP size; the checkpoint resumed is
the one at step 2, an epoch boundary (Lightning restarts a mid-epoch resume's data from the epoch's start, see
LIGHTNING.md). The fits of one world size share one launch of ranks that run_ranks forks and Lightning takes for
ranks torchrun started (helpers/launched.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from helpers.tp_toy import PlainTPModule, ToyTPModule, full_state, reference_states
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from safetensors.torch import load_file
from torch import Tensor

import zero_strategy.checkpoint.sharded.save as save_module
from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.export.cli import main as zero_to_fp32
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.pretrained.open import load_pretrained_into_module
from zero_strategy.checkpoint.sharded.tensor_parallel import TP_MANIFEST_NAME, TensorParallelManifest
from zero_strategy.checkpoint.sharded.tensor_parallel_blocks import _Block, open_for_run
from zero_strategy.checkpoint.sharded.tensor_parallel_save import _plan_staging
from zero_strategy.checkpoint.sharded.tensor_parallel_view import _Blocks
from zero_strategy.testing import run_ranks

SAMPLES, GLOBAL_ROWS, SAVED_AT, TOTAL = 8, 4, 2, 4  # 2 steps per epoch; resume at the end of epoch 0
CONFIGS = {"zero1": (1, "auto"), "zero3": (3, "auto"), "zero3_p2p": (3, "point_to_point")}
FAILED_SAVE_AT = 3  # a save over the step-2 checkpoint that fails on one rank (see FailOneSave)


def reference(steps: int) -> dict[str, Tensor]:
    """One process, no TP, the same steps on each step's global batch (tests/helpers/tp_toy.py)."""
    return reference_states(steps, GLOBAL_ROWS, samples=SAMPLES)


class FailOneSave(Callback):
    """At step FAILED_SAVE_AT, save over ``target`` with the shard write of global rank 1 (DP rank 0 of TP
    coordinate 1) failing: every rank must raise, and ``target`` must stay the checkpoint it was."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.outcome: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != FAILED_SAVE_AT or self.outcome:
            return
        before = TensorParallelManifest.read(self.target).checkpoint_id
        original = save_module.write_safetensors

        def broken(*a: Any, **k: Any) -> Any:
            raise OSError("disk full (planted)")

        if trainer.global_rank == 1:
            save_module.write_safetensors = broken  # type: ignore[assignment]
        try:
            trainer.save_checkpoint(self.target)
            self.outcome["error"] = None
        except CheckpointError as error:
            self.outcome["error"] = str(error)
        finally:
            save_module.write_safetensors = original
        self.outcome["ids"] = (before, TensorParallelManifest.read(self.target).checkpoint_id)
        self.outcome["versions"] = sorted(p.name for p in self.target.iterdir() if p.name.startswith("v-"))
        self.outcome["siblings"] = sorted(p.name for p in self.target.parent.iterdir() if ".partial-" in p.name)


def _trainer(strategy: ZeroStrategy, devices: int, callbacks: list[Callback]) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=TOTAL, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


def _strategy(stage: int, collectives: str, tensor_parallel_size: int = 2) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, collectives=collectives, tensor_parallel_size=tensor_parallel_size,
                        process_group_timeout_s=60.0)


def first_fits(rank: int, world: int, root: Path) -> dict[str, Any]:
    """4 ranks (2 DP x 2 TP): each configuration fits TOTAL steps, saving every SAVED_AT steps and ``last``."""
    as_launched_rank(rank, world)
    results: dict[str, Any] = {}
    for name, (stage, collectives) in CONFIGS.items():
        pl.seed_everything(0, verbose=False)
        saves = ModelCheckpoint(dirpath=root / name, filename="step={step}", auto_insert_metric_name=False,
                                every_n_train_steps=SAVED_AT, save_top_k=-1, save_last=True)
        failing = FailOneSave(root / name / f"step={SAVED_AT}.ckpt")
        module = ToyTPModule(rows=GLOBAL_ROWS // 2, samples=SAMPLES)
        _trainer(_strategy(stage, collectives), world, [saves, failing]).fit(module)
        results[name] = {"final": full_state(module.net), "failed_save": failing.outcome}
    pl.seed_everything(0, verbose=False)  # without tensor parallelism (DP 4), for a TP run to resume from
    saves = ModelCheckpoint(dirpath=root / "no_tp", filename="step={step}", auto_insert_metric_name=False,
                            every_n_train_steps=SAVED_AT, save_top_k=-1)
    plain = PlainTPModule(rows=GLOBAL_ROWS // 4, samples=SAMPLES)
    _trainer(_strategy(3, "auto", 1), world, [saves]).fit(plain)
    results["no_tp"] = {"final": {k: v.detach().clone() for k, v in plain.net.state_dict().items()}}
    return results


def _resume(module: pl.LightningModule, strategy: ZeroStrategy, world: int, root: Path, name: str) -> Any:
    pl.seed_everything(0, verbose=False)
    _trainer(strategy, world, []).fit(module, ckpt_path=root / name / f"step={SAVED_AT}.ckpt")
    return module


def resumed_fits(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Each configuration resumed from its step-2 checkpoint with tensor_parallel_size=2 on ``world`` ranks; on 2
    ranks also without tensor parallelism, on 8 also at TP 4 (DP 2)."""
    as_launched_rank(rank, world)
    dp = world // 2
    results: dict[str, Any] = {}
    for name, (stage, collectives) in CONFIGS.items():
        module = ToyTPModule(rows=GLOBAL_ROWS // dp, samples=SAMPLES)
        results[name] = full_state(_resume(module, _strategy(stage, collectives), world, root, name).net)
    if world == 2:  # no tensor parallelism: DP 2 over whole tensors; and TP 2 from a checkpoint saved without it
        plain = PlainTPModule(rows=GLOBAL_ROWS // 2, samples=SAMPLES)
        results["no_tp"] = full_state(_resume(plain, _strategy(3, "auto", 1), world, root, "zero3").net)
        module = ToyTPModule(rows=GLOBAL_ROWS, samples=SAMPLES)
        results["from_no_tp"] = full_state(_resume(module, _strategy(3, "auto"), world, root, "no_tp").net)
    if world == 8:  # TP 4 x DP 2: every block is a part of a saved block, or spans two
        for name in ("zero1", "zero3"):
            module = ToyTPModule(rows=GLOBAL_ROWS // 2, samples=SAMPLES)
            results[f"tp4_{name}"] = full_state(_resume(module, _strategy(CONFIGS[name][0], "auto", 4), world, root,
                                                        name).net)
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp_checkpoints")
    return root, run_ranks(first_fits, 4, root, timeout_s=150, pg_timeout_s=60.0)[0]


@pytest.fixture(scope="module")
def resumed(saved: tuple[Path, dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    root, _ = saved
    return {world: run_ranks(resumed_fits, world, root, timeout_s=200, pg_timeout_s=60.0) for world in (2, 8)}


# timeouts cover the fixtures' launches (4 ranks: 3 fits, 8 s; 2 and 8 ranks: 4 fits each, 25 s measured, both cores
# busy) when the test is the first to use them
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_uninterrupted_fit_matches_the_reference(saved: tuple[Path, dict[str, Any]], name: str) -> None:
    assert_state_close(saved[1][name]["final"], reference(TOTAL), what=f"{name}, uninterrupted")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_at_another_data_parallel_size_is_exact(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]], world: int, name: str
) -> None:
    for rank, results in enumerate(resumed[world]):  # every rank's whole model (gathered over its TP group)
        assert_state_close(results[name], saved[1][name]["final"], what=f"{name}, DP {world // 2}, rank {rank}")
        assert_state_close(results[name], reference(TOTAL), what=f"{name}, DP {world // 2}, rank {rank}")


@pytest.mark.timeout(300)
def test_a_run_without_tensor_parallelism_resumes_from_whole_tensors(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]]
) -> None:
    for rank, results in enumerate(resumed[2]):
        assert_state_close(results["no_tp"], saved[1]["zero3"]["final"], what=f"without TP, rank {rank}")


@pytest.mark.timeout(300)
def test_a_tensor_parallel_run_resumes_from_a_checkpoint_saved_without_it(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]]
) -> None:
    assert_state_close(saved[1]["no_tp"]["final"], reference(TOTAL), what="the run without TP, uninterrupted")
    for rank, results in enumerate(resumed[2]):
        assert_state_close(results["from_no_tp"], saved[1]["no_tp"]["final"], what=f"TP 2 from no TP, rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_resume_at_another_tensor_parallel_size_is_exact(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]], name: str
) -> None:
    for rank, results in enumerate(resumed[8]):
        assert_state_close(results[f"tp4_{name}"], saved[1][name]["final"], what=f"{name} at TP 4, rank {rank}")


@pytest.mark.timeout(300)
def test_a_checkpoint_of_another_model_is_refused_by_name(saved: tuple[Path, dict[str, Any]]) -> None:
    """Read as another TP size's blocks, a whole tensor of another shape is named (the same TP size goes through
    check_compatible, as every checkpoint does)."""
    module = PlainTPModule()
    module.net.emb = torch.nn.Embedding(33, 16)
    with pytest.raises(CheckpointError, match=r"net\.emb\.weight has shape \[32, 16\], the model's whole tensor "
                                              r"\[33, 16\]"):
        open_for_run(saved[0] / "zero1" / f"step={SAVED_AT}.ckpt", 4, 0, module)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_failed_save_leaves_the_previous_checkpoint(saved: tuple[Path, dict[str, Any]], name: str) -> None:
    root, results = saved
    outcome = results[name]["failed_save"]
    assert outcome["error"] is not None and "disk full (planted)" in outcome["error"], outcome
    before, after = outcome["ids"]
    assert before == after, "the manifest switched to a save that failed"
    assert outcome["versions"] == [f"v-{before}"], f"the failed save left {outcome['versions']}"
    assert outcome["siblings"] == [], outcome["siblings"]
    # and the checkpoint it kept is the one every resume above reads (test_resume_... holds its values)
    assert TensorParallelManifest.read(root / name / f"step={SAVED_AT}.ckpt").checkpoint_id == before


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_to_fp32_writes_the_whole_model(saved: tuple[Path, dict[str, Any]], name: str, tmp_path: Path) -> None:
    """``last.ckpt`` was overwritten at step 4 (a new version switched in): its export is the final whole model."""
    root, results = saved
    last = root / name / "last.ckpt"
    manifest = json.loads((last / TP_MANIFEST_NAME).read_text())
    assert sorted(p.name for p in last.iterdir() if p.name.startswith("v-")) == [manifest["version_dir"]]
    written = load_file(consolidate(last, tmp_path / "model.safetensors", progress=False))
    got = {key.removeprefix("net."): value for key, value in written.items()}
    assert_state_close(got, results[name]["final"], rel=0.0, what=f"{name}, zero-to-fp32")


@pytest.mark.parametrize(("rows", "lengths"), [(7, [3, 3, 1]), (7, [2, 2, 2, 1]), (3, [1, 1, 1, 0]), (4, [2, 2])])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_whole_tensor_ranges_read_from_the_blocks(rows: int, lengths: list[int], dim: int) -> None:
    """Every range of the whole tensor, read block by block, equals the whole tensor's own elements (uneven
    splits and an empty block included)."""
    shape = [2, 5, 3]
    shape[dim] = rows
    whole = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    blocks = [block.reshape(-1) for block in torch.split(whole, lengths, dim)]
    starts = [sum(lengths[:t]) for t in range(len(lengths))]
    split = _Blocks(dim, math.prod(shape[:dim]), rows, math.prod(shape[dim + 1 :]), starts, lengths)
    flat = whole.reshape(-1)
    for start in range(flat.numel()):
        for count in range(flat.numel() - start + 1):
            runs = split.runs(start, count)
            got = torch.cat([blocks[t][local : local + take] for t, local, take in runs]) if runs else flat[:0]
            assert torch.equal(got, flat[start : start + count]), (start, count, runs)


@pytest.mark.parametrize(("rows", "lengths"), [(7, [2, 2, 2, 1]), (3, [1, 1, 1, 0]), (4, [2, 2])])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_block_ranges_read_from_the_whole_tensor(rows: int, lengths: list[int], dim: int) -> None:
    """Every range of every block, read from the whole tensor, equals the block's own elements."""
    shape = [2, 5, 3]
    shape[dim] = rows
    whole = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    flat = whole.reshape(-1)
    start = 0
    for length, block in zip(lengths, torch.split(whole, lengths, dim), strict=True):
        values = block.reshape(-1)
        place = _Block(dim, rows, math.prod(shape[dim + 1 :]), start, length)
        for first in range(values.numel()):
            for count in range(values.numel() - first + 1):
                runs = place.whole_runs(first, count)
                got = torch.cat([flat[at : at + take] for at, take in runs]) if runs else values[:0]
                assert torch.equal(got, values[first : first + count]), (first, count, runs)
        start += length


def test_a_save_never_replaces_what_it_cannot_replace_in_one_step(tmp_path: Path) -> None:
    """The writer's staging: a file, an ordinary checkpoint or other files at the path are refused by name (a TP
    checkpoint could not replace them atomically); an absent path is staged in a hidden sibling."""
    (tmp_path / "file.ckpt").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        _plan_staging(tmp_path / "file.ckpt", "abc")
    (tmp_path / "plain.ckpt").mkdir()
    (tmp_path / "plain.ckpt" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="a checkpoint without tensor parallelism"):
        _plan_staging(tmp_path / "plain.ckpt", "abc")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="other files"):
        _plan_staging(tmp_path / "other", "abc")
    root, fresh = _plan_staging(tmp_path / "new.ckpt", "abc")
    assert fresh and root == tmp_path / ".new.ckpt.partial-abc" and (root / "v-abc").is_dir()
    assert not (tmp_path / "new.ckpt").exists()


@pytest.mark.timeout(300)
def test_zero_to_fp32_hf_writes_the_whole_model(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The command line's ``--hf`` on a tensor-parallel checkpoint: a Hugging Face directory of the whole model."""
    root, results = saved
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    out = tmp_path / "hf"
    argv = [str(root / "zero3" / "last.ckpt"), "--hf", str(out), "--hf-config", str(tmp_path / "config.json"),
            "--strip-prefix", "net.", "--no-name-check", "--no-progress"]
    assert zero_to_fp32(argv) == 0
    assert_state_close(load_file(out / "model.safetensors"), results["zero3"]["final"], rel=0.0, what="--hf")


@pytest.mark.timeout(300)
def test_pretrained_weights_from_a_tensor_parallel_checkpoint(saved: tuple[Path, dict[str, Any]]) -> None:
    """``pretrained=`` reads a tensor-parallel checkpoint as whole tensors (here into an ordinary module)."""
    root, results = saved
    module = PlainTPModule()
    load_pretrained_into_module(module, root / "zero1" / "last.ckpt")
    assert_state_close(module.net.state_dict(), results["zero1"]["final"], rel=0.0, what="pretrained")
