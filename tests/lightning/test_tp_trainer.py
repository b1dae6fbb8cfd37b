"""``ZeroStrategy(stage=s, tensor_parallel_size=2)`` on 4 CPU ranks (2 data-parallel x 2 tensor-parallel): a module
written for Lightning's ModelParallelStrategy (its TP plan applied in ``configure_model`` from ``self.device_mesh``)
trains under zero1/2/3 as one process without TP does the same steps on the global batch, and as
ModelParallelStrategy itself does on the same module, both run in the same launch (issue 36).

Every fit runs 3 AdamW steps with ``gradient_clip_val`` (the global norm over both mesh dimensions decides the
clipping coefficient, and a norm summed over TP wrongly moves every weight). Stage 3 runs on both paths: one host's
shared memory ("auto") and the network ("point_to_point"), and on gloo's own collectives ("native"). The fits run
one after another in one launch of four ranks that run_ranks forks and Lightning takes for ranks torchrun started.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from helpers.tp_toy import ToyTPModule, apply_plan, full_state, make_model, reference_run, reference_states
from lightning.pytorch.strategies import ModelParallelStrategy
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard

from zero_strategy import ZeroStrategy
from zero_strategy.adapter_plumbing.process_group import tensor_parallel_mesh
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.config import ZeroConfigError
from zero_strategy.testing import run_ranks

STEPS, ROWS_PER_RANK, CLIP, WORLD, TP = 3, 2, 0.5, 4, 2
PRECISIONS = ("bf16-mixed", "16-mixed")
SAVED_AFTER_FIT = ("zero1", "zero3-point_to_point")

FITS = {
    "zero1": lambda: ZeroStrategy(stage=1, tensor_parallel_size=TP),
    "zero2": lambda: ZeroStrategy(stage=2, tensor_parallel_size=TP),
    "zero3-auto": lambda: ZeroStrategy(stage=3, tensor_parallel_size=TP, collectives="auto"),
    "zero3-point_to_point": lambda: ZeroStrategy(stage=3, tensor_parallel_size=TP, collectives="point_to_point"),
    "zero3-native": lambda: ZeroStrategy(stage=3, tensor_parallel_size=TP, collectives="native"),
    "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=WORLD // TP, tensor_parallel_size=TP),
}


def _trainer(strategy: Any, steps: int = STEPS) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, gradient_clip_val=CLIP, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


class FullyShardedEverywhere(ToyTPModule):
    """Calls fully_shard whatever the strategy: ZeRO must refuse it by name."""

    def configure_model(self) -> None:
        apply_plan(self.net, self.device_mesh["tensor_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def _fit(name: str, save_dir: str) -> dict[str, Any]:
    trainer = _trainer(FITS[name]())
    module = ToyTPModule(rows=ROWS_PER_RANK)
    trainer.fit(module)
    if name in SAVED_AFTER_FIT:  # the engine released the module: the save writes what the module holds
        trainer.save_checkpoint(f"{save_dir}/{name}.ckpt")
    strategy = trainer.strategy
    return {"state": full_state(module.net), "sampler": strategy.distributed_sampler_kwargs,
            "mesh": tuple(strategy.device_mesh.shape)}


def _low_precision(precision: str) -> dict[str, Any]:
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, tensor_parallel_size=TP), accelerator="cpu", devices=WORLD, max_steps=STEPS,
        precision=precision, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = ToyTPModule(rows=ROWS_PER_RANK)
    trainer.fit(module)
    return {"state": full_state(module.net), "losses": module.losses}


def _pretrained(path: str) -> dict[str, Any]:
    """zero3 with pretrained= (the global tensors of another seed's model) and lr 0: the run starts from them."""
    trainer = _trainer(ZeroStrategy(stage=3, tensor_parallel_size=TP, pretrained=path), steps=1)
    module = ToyTPModule(rows=ROWS_PER_RANK, lr=0.0)
    trainer.fit(module)
    return {"state": full_state(module.net)}


def _refused(module: pl.LightningModule) -> str:
    try:
        _trainer(ZeroStrategy(stage=2, tensor_parallel_size=TP)).fit(module)
    except ValueError as error:
        return str(error)
    return "no error"


def fit_each(rank: int, world: int, pretrained: str, save_dir: str) -> dict[str, Any]:
    as_launched_rank(rank, world)
    results: dict[str, Any] = {name: _fit(name, save_dir) for name in FITS}
    results["pretrained"] = _pretrained(pretrained)
    for precision in PRECISIONS:
        results[precision] = _low_precision(precision)
    results["fully_shard"] = _refused(FullyShardedEverywhere())
    return results


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained file the runs read and the checkpoints they save after fit."""
    return Path(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def runs(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "pretrained.safetensors"
    save_file({f"net.{key}": value.contiguous() for key, value in make_model(seed=7).state_dict().items()}, str(path))
    return run_ranks(fit_each, WORLD, str(path), str(path.parent), timeout_s=600, pg_timeout_s=120.0)



@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return reference_states(STEPS, ROWS_PER_RANK * WORLD // TP, clip=CLIP)


# Each timeout covers the launch of every fit if its test is the first to use `runs` (about 40 s measured on a quiet
# machine, 2 cores for 4 ranks).
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FITS))
def test_every_stage_and_model_parallel_strategy_match_one_process(runs: list[dict[str, Any]], reference: Any,
                                                                  name: str) -> None:  # fmt: skip
    for rank, results in enumerate(runs):
        assert_state_close(results[name]["state"], reference, rel=1e-5, what=f"{name}, rank {rank}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in FITS if n.startswith("zero")])
def test_zero_equals_model_parallel_strategy(runs: list[dict[str, Any]], name: str) -> None:
    assert_state_close(runs[0][name]["state"], runs[0]["model_parallel"]["state"], rel=1e-5, what=name)


@pytest.mark.timeout(600)
def test_mesh_and_sampler_are_model_parallel_strategys(runs: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(runs):
        for name in FITS:
            assert results[name]["mesh"] == (WORLD // TP, TP), name
            # ranks 2d and 2d+1 form TP group d and see data-parallel rank d's batches
            assert results[name]["sampler"]["num_replicas"] == WORLD // TP, name
            assert results[name]["sampler"]["rank"] == rank // TP, name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_low_precision_trains_as_fp32_does_and_keeps_tensor_parallel_replicas_equal(
    runs: list[dict[str, Any]], precision: str
) -> None:
    """Mixed precision: the global loss of each step (the mean of the data-parallel ranks' losses) within 2e-2 of
    one fp32 process's (Adam's first steps move each weight by about lr whatever its gradient's size, so weights are
    compared between the ranks instead); the whole model equal on every rank (replicated blocks stepped alike: the
    fp16 overflow decision and the clipping coefficient agreed over both dimensions)."""
    _, reference_losses = reference_run(STEPS, ROWS_PER_RANK * WORLD // TP, clip=CLIP)
    data_parallel_ranks = range(0, WORLD, TP)
    for step, expected in enumerate(reference_losses):
        got = sum(runs[rank][precision]["losses"][step] for rank in data_parallel_ranks) / len(data_parallel_ranks)
        assert abs(got - expected) <= 2e-2 * abs(expected), (precision, step, got, expected)
    for rank, results in enumerate(runs):
        # fails on a non-finite value too (tests/helpers/compare.py)
        assert_state_close(results[precision]["state"], runs[0][precision]["state"], rel=0.0, what=f"rank {rank}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", SAVED_AFTER_FIT)
def test_a_save_after_fit_consolidates_to_the_trained_model(runs: list[dict[str, Any]], workdir: Path,
                                                            tmp_path: Path, name: str) -> None:  # fmt: skip
    output = consolidate(workdir / f"{name}.ckpt", tmp_path / "model.safetensors", progress=False)
    assert_state_close({k.removeprefix("net."): v for k, v in load_file(str(output)).items()},
                       runs[0][name]["state"], rel=0.0, what=name)


@pytest.mark.timeout(600)
def test_pretrained_weights_reach_each_tensor_parallel_block(runs: list[dict[str, Any]]) -> None:
    expected = {key: value.detach() for key, value in make_model(seed=7).state_dict().items()}
    for rank, results in enumerate(runs):
        assert_state_close(results["pretrained"]["state"], expected, rel=0.0, what=f"rank {rank}")


@pytest.mark.timeout(600)
def test_a_module_fully_sharded_by_fsdp2_is_refused_by_name(runs: list[dict[str, Any]]) -> None:
    for results in runs:
        assert re.search(r"already sharded by FSDP2's fully_shard.*only under ModelParallelStrategy",
                         results["fully_shard"]), results["fully_shard"]


@pytest.mark.timeout(30)
def test_a_tensor_parallel_size_that_does_not_divide_the_world_is_refused() -> None:
    with pytest.raises(ZeroConfigError, match=r"tensor_parallel_size=3 does not divide the world of 4 ranks"):
        tensor_parallel_mesh("cpu", 4, 3)
    with pytest.raises(ZeroConfigError, match=r"tensor_parallel_size=0"):
        ZeroStrategy(stage=3, tensor_parallel_size=0)
