"""DCP checkpoints of tensor-parallel runs (issue 36): ``ZeroStrategy(stage=s, tensor_parallel_size=2,
checkpoint_format="dcp")`` on 4 ranks (2 DP x 2 TP) writes one DCP directory of whole tensors for the world (see
[Note: DCP boxes of a tensor-parallel block] in zero_strategy/checkpoint/dcp/tensor_parallel.py); it resumes at DP
1 (2 ranks) and DP 4 (8 ranks), at TP 4 (8 ranks) and without tensor parallelism (and a DCP checkpoint saved without
it resumes at TP 2), equal to the uninterrupted run and to a single-process reference; torch's ``dcp.load`` fills a
DTensor state dict of the same plan from it; a save that fails on one rank leaves the previous checkpoint as it was.

Layouts are comparable as in test_tp_checkpoints.py (8 samples, a global batch of 4, 2 steps per epoch; the
checkpoint resumed is the one at step 2, an epoch boundary). The fits of one world size share one launch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from helpers.tp_toy import (
    PlainTPModule,
    ToyTPModule,
    apply_plan,
    full_state,
    make_model,
    reference_states,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh

import zero_strategy.checkpoint.dcp.planner as planner
from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.dcp.content import add_range
from zero_strategy.checkpoint.dcp.planner import ChunkedTensor
from zero_strategy.checkpoint.dcp.tensor_parallel import Placed
from zero_strategy.testing import run_ranks

SAMPLES, GLOBAL_ROWS, SAVED_AT, TOTAL = 8, 4, 2, 4  # 2 steps per epoch; resume at the end of epoch 0
FAILED_SAVE_AT = 3  # a save over the step-2 checkpoint that fails on one rank (see FailOneSave)
CONFIGS = {"zero1": (1, "auto"), "zero2": (2, "auto"), "zero3": (3, "auto"), "zero3_p2p": (3, "point_to_point")}


def reference(steps: int) -> dict[str, Tensor]:
    """One process, no TP, the same steps on each step's global batch (tests/helpers/tp_toy.py)."""
    return reference_states(steps, GLOBAL_ROWS, samples=SAMPLES)


class FailOneSave(pl.Callback):
    """At step FAILED_SAVE_AT, save over ``target`` with world rank 1 (DP rank 0 of TP coordinate 1) failing while
    it produces a box: every rank must raise, and ``target`` must stay the checkpoint it was, byte for byte."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.outcome: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != FAILED_SAVE_AT or self.outcome:
            return
        before = _files(self.target)
        original = planner.ChunkedSavePlanner.resolve_data

        def broken(*a: Any, **k: Any) -> Any:
            raise OSError("disk full (planted)")

        if trainer.global_rank == 1:
            planner.ChunkedSavePlanner.resolve_data = broken  # type: ignore[method-assign]
        try:
            trainer.save_checkpoint(self.target)
            self.outcome["error"] = None
        except CheckpointError as error:
            self.outcome["error"] = str(error)
        finally:
            planner.ChunkedSavePlanner.resolve_data = original  # type: ignore[method-assign]
        self.outcome["unchanged"] = _files(self.target) == before
        self.outcome["siblings"] = sorted(p.name for p in self.target.parent.iterdir() if p.name.startswith("."))


def _files(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` (a folder: None) with its bytes."""
    return {str(path.relative_to(directory)): path.read_bytes() if path.is_file() else None
            for path in sorted(directory.rglob("*"))}


def _trainer(strategy: ZeroStrategy, devices: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=TOTAL, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


def _strategy(stage: int, collectives: str, tensor_parallel_size: int = 2) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, collectives=collectives, tensor_parallel_size=tensor_parallel_size,
                        checkpoint_format="dcp", process_group_timeout_s=60.0)


def _saved(root: Path, name: str) -> Path:
    return root / name / f"step={SAVED_AT}.ckpt"


def first_fits(rank: int, world: int, root: Path) -> dict[str, Any]:
    """4 ranks (2 DP x 2 TP): each configuration fits TOTAL steps saving DCP checkpoints every SAVED_AT steps (and a
    run without TP, DP 4); then
    torch's own dcp.load fills a fresh ToyNet under the same plan (DTensors on the same mesh) from zero3's step 2."""
    as_launched_rank(rank, world)
    results: dict[str, Any] = {}
    for name, (stage, collectives) in CONFIGS.items():
        pl.seed_everything(0, verbose=False)
        saves = ModelCheckpoint(dirpath=root / name, filename="step={step}", auto_insert_metric_name=False,
                                every_n_train_steps=SAVED_AT, save_top_k=-1)
        failing = FailOneSave(_saved(root, name))
        module = ToyTPModule(rows=GLOBAL_ROWS // 2, samples=SAMPLES)
        _trainer(_strategy(stage, collectives), world, [saves, failing]).fit(module)
        results[name] = full_state(module.net)
        results[f"{name}_failed_save"] = failing.outcome
    pl.seed_everything(0, verbose=False)  # without tensor parallelism (DP 4), for a TP run to resume from
    saves = ModelCheckpoint(dirpath=root / "no_tp", filename="step={step}", auto_insert_metric_name=False,
                            every_n_train_steps=SAVED_AT, save_top_k=-1)
    plain = PlainTPModule(rows=GLOBAL_ROWS // 4, samples=SAMPLES)
    _trainer(_strategy(3, "auto", 1), world, [saves]).fit(plain)
    results["no_tp"] = {key: value.detach().clone() for key, value in plain.net.state_dict().items()}
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    net = make_model(seed=1)  # other values than the checkpoint's: every one must come from it
    apply_plan(net, mesh["tensor_parallel"])
    state = {"model": {f"net.{key}": value for key, value in net.state_dict().items()}}  # the LightningModule's keys
    dcp.load(state, checkpoint_id=_saved(root, "zero3"))
    net.load_state_dict({key.removeprefix("net."): value for key, value in state["model"].items()})
    results["dcp_load"] = full_state(net)
    return results


def _resume(module: pl.LightningModule, strategy: ZeroStrategy, world: int, root: Path, name: str) -> Any:
    pl.seed_everything(0, verbose=False)
    _trainer(strategy, world, []).fit(module, ckpt_path=_saved(root, name))
    return module


def resumed_fits(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Each configuration resumed from its step-2 DCP checkpoint with tensor_parallel_size=2 on ``world`` ranks; on
    2 ranks also without tensor parallelism (DP 2), on 8 also at TP 4 (DP 2)."""
    as_launched_rank(rank, world)
    dp = world // 2
    results: dict[str, Any] = {}
    for name, (stage, collectives) in CONFIGS.items():
        module = ToyTPModule(rows=GLOBAL_ROWS // dp, samples=SAMPLES)
        results[name] = full_state(_resume(module, _strategy(stage, collectives), world, root, name).net)
    if world == 2:
        plain = PlainTPModule(rows=GLOBAL_ROWS // 2, samples=SAMPLES)
        results["no_tp"] = full_state(_resume(plain, _strategy(3, "auto", 1), world, root, "zero3").net)
        module = ToyTPModule(rows=GLOBAL_ROWS, samples=SAMPLES)
        results["from_no_tp"] = full_state(_resume(module, _strategy(3, "auto"), world, root, "no_tp").net)
    if world == 8:
        for name in ("zero1", "zero3"):
            module = ToyTPModule(rows=GLOBAL_ROWS // 2, samples=SAMPLES)
            strategy = _strategy(CONFIGS[name][0], "auto", 4)
            results[f"tp4_{name}"] = full_state(_resume(module, strategy, world, root, name).net)
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp_dcp")
    return root, run_ranks(first_fits, 4, root, timeout_s=150, pg_timeout_s=60.0)[0]


@pytest.fixture(scope="module")
def resumed(saved: tuple[Path, dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    root, _ = saved
    return {world: run_ranks(resumed_fits, world, root, timeout_s=200, pg_timeout_s=60.0) for world in (2, 8)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_uninterrupted_fit_matches_the_reference(saved: tuple[Path, dict[str, Any]], name: str) -> None:
    assert_state_close(saved[1][name], reference(TOTAL), what=f"{name}, uninterrupted, DCP saves")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_directory_of_whole_tensors(saved: tuple[Path, dict[str, Any]], name: str) -> None:
    """DCP's metadata records every parameter and its Adam state at the whole shape, tiled exactly once."""
    metadata = FileSystemReader(_saved(saved[0], name)).read_metadata()
    whole = reference(0)
    for key, value in whole.items():
        fqn = f"net.{key}"  # the LightningModule's
        for stored in (f"model.{fqn}", f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            md = metadata.state_dict_metadata[stored]
            assert isinstance(md, TensorStorageMetadata) and list(md.size) == list(value.shape), (stored, md)
            covered = torch.zeros(value.shape, dtype=torch.int32)
            for chunk in md.chunks:
                covered[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))] += 1
            assert bool((covered == 1).all()), f"{stored}: the boxes do not tile it once"
    rng = sorted(key for key in metadata.state_dict_metadata if key.startswith("zero_strategy.rng."))
    assert rng == [f"zero_strategy.rng.{rank}" for rank in range(4)], rng  # every world rank's


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_failed_save_leaves_the_previous_checkpoint(saved: tuple[Path, dict[str, Any]], name: str) -> None:
    outcome = saved[1][f"{name}_failed_save"]
    assert outcome["error"] is not None and "disk full (planted)" in outcome["error"], outcome
    assert outcome["unchanged"], "the failed save changed the previous checkpoint's files"
    assert outcome["siblings"] == [], outcome["siblings"]
    # and the checkpoint it kept is the one every resume below reads (their values are checked there)


@pytest.mark.timeout(300)
def test_dcp_load_fills_a_dtensor_model_of_the_same_plan(saved: tuple[Path, dict[str, Any]]) -> None:
    assert_state_close(saved[1]["dcp_load"], reference(SAVED_AT), what="dcp.load into the DTensor state dict")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_at_another_data_parallel_size_is_exact(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]], world: int, name: str
) -> None:
    for rank, results in enumerate(resumed[world]):
        assert_state_close(results[name], saved[1][name], what=f"{name}, DP {world // 2}, rank {rank}")
        assert_state_close(results[name], reference(TOTAL), what=f"{name}, DP {world // 2}, rank {rank}")


@pytest.mark.timeout(300)
def test_a_run_without_tensor_parallelism_resumes(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]]
) -> None:
    for rank, results in enumerate(resumed[2]):
        assert_state_close(results["no_tp"], saved[1]["zero3"], what=f"without TP, rank {rank}")


@pytest.mark.timeout(300)
def test_a_tensor_parallel_run_resumes_from_a_dcp_checkpoint_saved_without_it(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]]
) -> None:
    assert_state_close(saved[1]["no_tp"], reference(TOTAL), what="the run without TP, uninterrupted")
    for rank, results in enumerate(resumed[2]):
        assert_state_close(results["from_no_tp"], saved[1]["no_tp"], what=f"TP 2 from no TP, rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_resume_at_another_tensor_parallel_size_is_exact(
    saved: tuple[Path, dict[str, Any]], resumed: dict[int, list[dict[str, Any]]], name: str
) -> None:
    for rank, results in enumerate(resumed[8]):
        assert_state_close(results[f"tp4_{name}"], saved[1][name], what=f"{name} at TP 4, rank {rank}")


@pytest.mark.parametrize("shape, dim, start, length", [((6, 10), 1, 4, 3), ((6, 10), 0, 2, 3), ((3, 4, 5), 1, 1, 2),
                                                        ((3, 4, 5), 2, 3, 2)])
def test_a_block_range_becomes_boxes_of_the_whole_tensor(
    shape: tuple[int, ...], dim: int, start: int, length: int
) -> None:
    """Every flat range of a Shard(dim) block: its boxes, shifted to the block's place, hold exactly the whole
    tensor's values there, and each is one contiguous run of the range (the slice a rank holds)."""
    whole = torch.arange(float(torch.Size(shape).numel())).view(shape)
    block = whole.narrow(dim, start, length).contiguous()
    offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
    placed = Placed(shape, tuple(block.shape), offsets, True)
    flat = block.reshape(-1)
    for first in range(0, flat.numel(), 3):
        for count in (1, 7, flat.numel() - first):
            count = min(count, flat.numel() - first)
            tensor = ChunkedTensor(shape, whole.dtype)
            add_range(tensor, first, count, lambda a, n: flat[a : a + n], placed)
            assert sum(torch.Size(c.sizes).numel() for c in tensor.chunks) == count
            assert len(tensor.chunks) <= 2 * (len(shape) - 1) + 1
            for chunk in tensor.chunks:
                index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
                assert torch.equal(chunk.read(), whole[index]), (first, count, chunk.offsets, chunk.sizes)
