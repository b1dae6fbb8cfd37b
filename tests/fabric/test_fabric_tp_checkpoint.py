"""``fabric.save`` / ``fabric.load`` of a tensor-parallel module (issue 36): ``ZeroFabricStrategy(stage=s,
tensor_parallel_size=2, parallelize_fn=fn)`` on 4 ranks (2 data-parallel x 2 tensor-parallel) trains
tests/helpers/tp_toy.py's ToyNet SAVED_AT steps, saves ``{"model", "optimizer", "step"}`` (the Trainer's
tensor-parallel layout: one sharded checkpoint per TP coordinate, ``tensor_parallel.json`` switched last), then a
save over it fails on one rank, and the run trains MORE steps: the uninterrupted run. The checkpoint then resumes
for MORE steps at the same layout (loaded back in place), at DP 1 (2 ranks) and DP 4 (8 ranks) with TP 2, at TP 4
(8 ranks, DP 2) and in a run without tensor parallelism (2 ranks, DP 2); and a checkpoint saved without tensor
parallelism resumes at TP 2: each equal within 1e-5 to the uninterrupted run and to the single-process reference.
Stages 1 and 3 (stage 3 on "auto" and "point_to_point"). Also: the failed save kept the old checkpoint;
``zero-to-fp32`` writes the whole model; ``fabric.load(path)`` without a state returns the plain entries; what stays
unsupported (``load_raw``, the consolidated file) is refused by name.

Each step's global batch is ``global_batch(step, GLOBAL_ROWS)`` dealt by hand to the data-parallel ranks (a TP
group's ranks take the same rows), so every layout trains on the same rows as the reference. The fits of one world
size share one launch of ranks that run_ranks forks and Fabric takes for ranks torchrun started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from helpers.tp_toy import apply_plan, full_state, global_batch, loss_of, make_model, reference_states
from lightning.fabric import Fabric
from safetensors.torch import load_file
from torch import nn

import zero_strategy.checkpoint.sharded.save as save_module
from zero_strategy import ZeroFabricStrategy
from zero_strategy.checkpoint.base.format import MANIFEST_NAME, CheckpointError
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.sharded.tensor_parallel import TP_MANIFEST_NAME, TensorParallelManifest
from zero_strategy.fabric.tensor_parallel import TensorParallelCheckpointError
from zero_strategy.testing import run_ranks

TP, GLOBAL_ROWS, SAVED_AT, MORE, LR = 2, 4, 2, 2, 1e-2
CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": dict(stage=1),
    "zero3": dict(stage=3, collectives="auto"),
    "zero3_p2p": dict(stage=3, collectives="point_to_point"),
}
FAILING_RANK = 1  # DP rank 0 of TP coordinate 1: its shard write fails in the planted save


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    apply_plan(model, mesh["tensor_parallel"])  # type: ignore[arg-type]
    return model


def _fabric(world: int, tensor_parallel_size: int, zero: dict[str, Any], plan: bool = False) -> Fabric:
    """``plan``: a parallelize_fn with tensor_parallel_size=1 too (its mesh is ``(world, 1)``)."""
    fn = parallelize if tensor_parallel_size > 1 or plan else None
    strategy = ZeroFabricStrategy(**zero, tensor_parallel_size=tensor_parallel_size, parallelize_fn=fn,
                                  process_group_timeout_s=60.0)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision="32-true")
    fabric.launch()
    return fabric


def _state(fabric: Fabric) -> dict[str, Any]:
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return {"model": model, "optimizer": optimizer, "step": 0}


def _train(fabric: Fabric, state: dict[str, Any], count: int, tensor_parallel_size: int) -> None:
    """``count`` steps from ``state["step"]``: each data-parallel rank its consecutive rows of the global batch."""
    dp = fabric.world_size // tensor_parallel_size
    data_rank, per = fabric.global_rank // tensor_parallel_size, GLOBAL_ROWS // dp
    for step in range(state["step"], state["step"] + count):
        tokens, targets = global_batch(step, GLOBAL_ROWS)
        rows = slice(data_rank * per, (data_rank + 1) * per)
        fabric.backward(loss_of(state["model"], (tokens[rows], targets[rows])))
        state["optimizer"].step()
        state["optimizer"].zero_grad()
    state["step"] += count


def _failing_save(fabric: Fabric, state: dict[str, Any], target: Path) -> dict[str, Any]:
    """A save over ``target`` whose shard write fails on FAILING_RANK: every rank must raise, ``target`` unchanged."""
    outcome: dict[str, Any] = {"before": TensorParallelManifest.read(target).checkpoint_id}
    original = save_module.write_safetensors

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full (planted)")

    if fabric.global_rank == FAILING_RANK:
        save_module.write_safetensors = broken  # type: ignore[assignment]
    try:
        fabric.save(target, state)
        outcome["error"] = None
    except CheckpointError as error:
        outcome["error"] = str(error)
    finally:
        save_module.write_safetensors = original
    outcome["after"] = TensorParallelManifest.read(target).checkpoint_id
    outcome["versions"] = sorted(p.name for p in target.iterdir() if p.name.startswith("v-"))
    outcome["siblings"] = sorted(p.name for p in target.parent.iterdir() if ".partial-" in p.name)
    return outcome


def _refused(fabric: Fabric, state: dict[str, Any], path: Path) -> list[str]:
    """What stays unsupported with a tensor-parallel module: each call must raise TensorParallelCheckpointError."""
    messages = []
    for call in (lambda: fabric.load_raw(path, state["model"]),
                 lambda: fabric.save(path.parent / "filtered.pt", state, filter={"model": lambda k, v: True})):
        try:
            call()
            messages.append("not refused")
        except TensorParallelCheckpointError as error:
            messages.append(str(error))
    return messages


def save_and_continue(rank: int, world: int, root: Path) -> dict[str, Any]:
    """4 ranks, DP 2 x TP 2: each configuration trains, saves, fails a save, trains on (the uninterrupted run), then
    loads its checkpoint back in place and trains the same steps again."""
    as_launched_rank(rank, world)
    results: dict[str, Any] = {}
    for name, zero in CONFIGS.items():
        fabric = _fabric(world, TP, zero)
        state = _state(fabric)
        _train(fabric, state, SAVED_AT, TP)
        target = root / name / "checkpoint"
        fabric.save(target, state)
        result: dict[str, Any] = {"saved": full_state(state["model"])}
        result["failed_save"] = _failing_save(fabric, state, target)
        _train(fabric, state, MORE, TP)
        result["final"] = full_state(state["model"])
        state["step"] = -1
        fabric.load(target, state)  # in place, over the trained weights and optimizer state
        result["loaded_step"] = state["step"]
        result["loaded"] = full_state(state["model"])
        _train(fabric, state, MORE, TP)
        result["same_layout"] = full_state(state["model"])
        if name == "zero1":
            result["refused"] = _refused(fabric, state, target)
        results[name] = result
        fabric.barrier()
    fabric = _fabric(world, 1, CONFIGS["zero3"])  # without tensor parallelism (DP 4), for a TP run to resume from
    state = _state(fabric)
    _train(fabric, state, SAVED_AT, 1)
    fabric.save(root / "no_tp" / "checkpoint", state)
    _train(fabric, state, MORE, 1)
    results["no_tp"] = {"final": full_state(state["model"])}
    return results


def _resumed(world: int, tensor_parallel_size: int, zero: dict[str, Any], path: Path,
             plan: bool = False, save_to: Path | None = None) -> dict[str, Any]:
    """Load ``path``, train MORE steps (then save at ``save_to``)."""
    fabric = _fabric(world, tensor_parallel_size, zero, plan)
    state = _state(fabric)
    fabric.load(path, state)
    loaded_step = state["step"]
    _train(fabric, state, MORE, tensor_parallel_size)
    result = {"step": loaded_step, "final": full_state(state["model"])}
    if save_to is not None:
        fabric.save(save_to, state)
    fabric.barrier()
    return result


def resume(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Each configuration's checkpoint resumed with TP 2 on ``world`` ranks; on 2 ranks also without tensor
    parallelism (DP 2, whole tensors), TP 2 from the checkpoint saved without it, and a load without a state; on 8
    ranks also at TP 4 (DP 2)."""
    as_launched_rank(rank, world)
    results: dict[str, Any] = {}
    for name, zero in CONFIGS.items():
        results[name] = _resumed(world, TP, zero, root / name / "checkpoint")
    if world == 2:
        results["no_tp"] = _resumed(world, 1, CONFIGS["zero3"], root / "zero3" / "checkpoint")
        results["plan_tp1"] = _resumed(world, 1, CONFIGS["zero3"], root / "zero3" / "checkpoint", plan=True,
                                       save_to=root / "plan_tp1" / "checkpoint")
        results["from_no_tp"] = _resumed(world, TP, CONFIGS["zero3"], root / "no_tp" / "checkpoint")
        fabric = _fabric(world, TP, CONFIGS["zero1"])
        results["plain_only"] = fabric.load(root / "zero1" / "checkpoint")
    if world == 8:  # TP 4 x DP 2: every block is a part of a saved block
        for name in ("zero1", "zero3"):
            results[f"tp4_{name}"] = _resumed(world, 4, CONFIGS[name], root / name / "checkpoint")
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("fabric_tp_checkpoints")
    return root, run_ranks(save_and_continue, 4, root, timeout_s=240, pg_timeout_s=60.0)


@pytest.fixture(scope="module")
def resumed(saved: tuple[Path, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    return {world: run_ranks(resume, world, saved[0], timeout_s=300, pg_timeout_s=60.0) for world in (2, 8)}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    return {"saved": reference_states(SAVED_AT, GLOBAL_ROWS, lr=LR),
            "final": reference_states(SAVED_AT + MORE, GLOBAL_ROWS, lr=LR)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_uninterrupted_run_and_a_load_in_place_match_the_reference(
    saved: tuple[Path, list[dict[str, Any]]], reference: dict[str, dict[str, torch.Tensor]], name: str
) -> None:
    for rank, results in enumerate(saved[1]):
        got = results[name]
        assert_state_close(got["saved"], reference["saved"], what=f"{name}, rank {rank}, at the save")
        assert_state_close(got["final"], reference["final"], what=f"{name}, rank {rank}, uninterrupted")
        assert got["loaded_step"] == SAVED_AT, got["loaded_step"]
        assert_state_close(got["loaded"], got["saved"], rel=0.0, what=f"{name}, rank {rank}, loaded in place")
        assert_state_close(got["same_layout"], got["final"], what=f"{name}, rank {rank}, resumed at DP 2")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_at_another_data_parallel_size_is_exact(
    saved: tuple[Path, list[dict[str, Any]]], resumed: dict[int, list[dict[str, Any]]],
    reference: dict[str, dict[str, torch.Tensor]], world: int, name: str,
) -> None:
    for rank, results in enumerate(resumed[world]):
        what = f"{name}, DP {world // TP}, rank {rank}"
        assert results[name]["step"] == SAVED_AT, (what, results[name]["step"])
        assert_state_close(results[name]["final"], saved[1][0][name]["final"], what=what)
        assert_state_close(results[name]["final"], reference["final"], what=f"{what} vs one process")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_resume_at_another_tensor_parallel_size_is_exact(
    saved: tuple[Path, list[dict[str, Any]]], resumed: dict[int, list[dict[str, Any]]],
    reference: dict[str, dict[str, torch.Tensor]], name: str,
) -> None:
    for rank, results in enumerate(resumed[8]):
        got = results[f"tp4_{name}"]
        assert got["step"] == SAVED_AT
        assert_state_close(got["final"], saved[1][0][name]["final"], what=f"{name} at TP 4, rank {rank}")
        assert_state_close(got["final"], reference["final"], what=f"{name} at TP 4, rank {rank} vs one process")


@pytest.mark.timeout(600)
def test_a_run_without_tensor_parallelism_resumes_from_whole_tensors(
    saved: tuple[Path, list[dict[str, Any]]], resumed: dict[int, list[dict[str, Any]]]
) -> None:
    for rank, results in enumerate(resumed[2]):
        assert results["no_tp"]["step"] == SAVED_AT
        assert_state_close(results["no_tp"]["final"], saved[1][0]["zero3"]["final"], what=f"without TP, rank {rank}")
        # the plan on a (2, 1) mesh: DTensor parameters whose blocks are the whole tensors
        assert results["plan_tp1"]["step"] == SAVED_AT
        assert_state_close(results["plan_tp1"]["final"], saved[1][0]["zero3"]["final"], what=f"TP 1 plan, rank {rank}")
        assert results["plain_only"] == {"step": SAVED_AT}, results["plain_only"]


@pytest.mark.timeout(600)
def test_a_tensor_parallel_run_resumes_from_a_checkpoint_saved_without_it(
    saved: tuple[Path, list[dict[str, Any]]], resumed: dict[int, list[dict[str, Any]]],
    reference: dict[str, dict[str, torch.Tensor]],
) -> None:
    uninterrupted = saved[1][0]["no_tp"]["final"]
    assert_state_close(uninterrupted, reference["final"], what="the run without TP, uninterrupted")
    for rank, results in enumerate(resumed[2]):
        assert results["from_no_tp"]["step"] == SAVED_AT
        assert_state_close(results["from_no_tp"]["final"], uninterrupted, what=f"TP 2 from no TP, rank {rank}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_failed_save_keeps_the_previous_checkpoint(saved: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    root, runs = saved
    for rank, results in enumerate(runs):  # every rank raised, naming the failure
        outcome = results[name]["failed_save"]
        assert outcome["error"] is not None and "disk full (planted)" in outcome["error"], (rank, outcome)
        assert outcome["before"] == outcome["after"], "the manifest switched to a save that failed"
        assert outcome["versions"] == [f"v-{outcome['before']}"], outcome["versions"]
        assert outcome["siblings"] == [], outcome["siblings"]
    # and the checkpoint it kept is the one every resume reads (the resume tests hold its values)
    kept = TensorParallelManifest.read(root / name / "checkpoint").checkpoint_id
    assert kept == runs[0][name]["failed_save"]["before"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_to_fp32_writes_the_whole_model(
    saved: tuple[Path, list[dict[str, Any]]], reference: dict[str, dict[str, torch.Tensor]], name: str,
    tmp_path: Path,
) -> None:
    root, runs = saved
    written = load_file(consolidate(root / name / "checkpoint", tmp_path / "model.safetensors", progress=False))
    assert_state_close(written, runs[0][name]["saved"], rel=0.0, what=f"{name}, zero-to-fp32")
    assert_state_close(written, reference["saved"], what=f"{name}, zero-to-fp32 vs one process")


@pytest.mark.timeout(600)
def test_what_stays_unsupported_is_refused_by_name(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, results in enumerate(saved[1]):
        raw, filtered = results["zero1"]["refused"]
        assert raw.startswith("ZeRO: fabric.load_raw of a tensor-parallel module"), (rank, raw)
        assert filtered.startswith("ZeRO: fabric.save as one consolidated file"), (rank, filtered)
        assert all("fabric.load(path, state)" in message for message in (raw, filtered))  # what works instead


@pytest.mark.timeout(600)
def test_a_plan_on_a_mesh_of_tensor_parallel_size_1_saves_whole_tensors(
    saved: tuple[Path, list[dict[str, Any]]], resumed: dict[int, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """A parallelize_fn with tensor_parallel_size=1 (DTensor parameters over a ``(world, 1)`` mesh) writes an
    ordinary sharded checkpoint of whole tensors."""
    path = saved[0] / "plan_tp1" / "checkpoint"
    assert not (path / TP_MANIFEST_NAME).exists() and (path / MANIFEST_NAME).is_file()
    written = load_file(consolidate(path, tmp_path / "model.safetensors", progress=False))
    assert_state_close(written, resumed[2][0]["plan_tp1"]["final"], rel=0.0, what="TP 1 plan, zero-to-fp32")
