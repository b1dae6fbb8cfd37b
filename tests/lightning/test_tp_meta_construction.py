"""Sharded construction with a tensor-parallel plan (issue 36): a LightningModule whose ``configure_model`` builds
its network (on the meta device under ZeRO, recorded) and then applies the TP plan from ``self.device_mesh`` trains
under zero1 and zero3 (on one host's shared memory and on the network path) on 4 CPU ranks (2 data-parallel x 2
tensor-parallel) exactly as one process without TP trains the same network built eagerly from the same seed
(``tp_toy.reference_states``): every rank replays the recorded construction, gets each parameter's whole initial
value (bit for bit the eager build's) and keeps its TP block and ZeRO range of it, never the whole model at once.

The fits run one after another in one launch of four ranks that run_ranks forks and Lightning takes for ranks
torchrun started (as tests/lightning/test_tp_trainer.py does). The same holds for a network built under
``Trainer.init_module(empty_init=True)`` whose plan ``configure_model`` applies (zero2, zero3).
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
from helpers.tp_toy import Tokens, ToyNet, ToyTPModule, apply_plan, full_state, loss_of, make_model, reference_states
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.testing import run_ranks

STEPS, ROWS_PER_RANK, CLIP, WORLD, TP = 3, 2, 0.5, 4, 2

FITS = {
    "zero1": lambda: ZeroStrategy(stage=1, tensor_parallel_size=TP),
    "zero3-auto": lambda: ZeroStrategy(stage=3, tensor_parallel_size=TP, collectives="auto",
                                       full_params_after_fit=True),
    # the default after fit for a model built sharded at stage 3: it stays sharded; a save writes it
    "zero3-point_to_point": lambda: ZeroStrategy(stage=3, tensor_parallel_size=TP, collectives="point_to_point"),
    # built under Trainer.init_module(empty_init=True), the plan applied in configure_model
    "zero2-init_module": lambda: ZeroStrategy(stage=2, tensor_parallel_size=TP),
    "zero3-init_module": lambda: ZeroStrategy(stage=3, tensor_parallel_size=TP, full_params_after_fit=True),
}
SAVED_AFTER_FIT = ("zero3-point_to_point",)


class BuiltInConfigureModel(ToyTPModule):
    """ToyNet built in ``configure_model`` after ``torch.manual_seed(0)`` (the seed ``make_model`` uses), then the
    plan applied to it, as a module written for ModelParallelStrategy that builds a model too large for one rank."""

    def __init__(self) -> None:
        super().__init__(rows=ROWS_PER_RANK)
        self.net: ToyNet | None = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = ToyNet()
        apply_plan(self.net, self.device_mesh["tensor_parallel"])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        assert self.net is not None
        self.log("val_loss", loss_of(self.net, batch), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(8), batch_size=self.rows)


class InitializedAfterThePlan(BuiltInConfigureModel):
    """Initializes a DTensor parameter after the plan distributed it: its values are no block of a recorded whole
    tensor, so the engine must refuse it by name."""

    def configure_model(self) -> None:
        super().configure_model()
        assert self.net is not None
        torch.nn.init.normal_(self.net.out.weight)


def _refused(module: pl.LightningModule) -> str:
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, tensor_parallel_size=TP), accelerator="cpu", devices=WORLD, max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(module)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _fit(name: str, save_dir: str) -> dict[str, Any]:
    trainer = pl.Trainer(
        strategy=FITS[name](), accelerator="cpu", devices=WORLD, max_steps=STEPS, gradient_clip_val=CLIP,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    if name.endswith("init_module"):
        with trainer.init_module(empty_init=True):
            module: ToyTPModule = ToyTPModule(rows=ROWS_PER_RANK)  # make_model(): seed 0, then ToyNet()
    else:
        module = BuiltInConfigureModel()
    trainer.fit(module)
    engine = trainer.strategy._sharded.engine
    assert engine is not None and module.net is not None
    result: dict[str, Any] = {"built_sharded": engine.built_sharded, "replay_peak": engine.replay_stats.peak_bytes}
    if name in SAVED_AFTER_FIT:  # left sharded: the module holds no values, the save writes the slices
        # a later run on the same Trainer takes the slices back (each rank its own ranges of its TP blocks) and
        # leaves them sharded again: the save after it writes the trained model
        trainer.validate(module, verbose=False)
        trainer.save_checkpoint(f"{save_dir}/{name}.ckpt")
    else:
        result["state"] = full_state(module.net)
    return result


def fit_each(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    as_launched_rank(rank, world)
    results: dict[str, Any] = {name: _fit(name, save_dir) for name in FITS}
    results["initialized_after_the_plan"] = _refused(InitializedAfterThePlan())  # last: a failed fit
    return results


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("tpmeta"))


@pytest.fixture(scope="module")
def runs(workdir: Path) -> list[dict[str, Any]]:
    return run_ranks(fit_each, WORLD, str(workdir), timeout_s=600, pg_timeout_s=120.0)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return reference_states(STEPS, ROWS_PER_RANK * WORLD // TP, clip=CLIP)


def _model_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in make_model().parameters())


# Each timeout covers the launch of every fit if its test is the first to use `runs`.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in FITS if n not in SAVED_AFTER_FIT])
def test_built_in_configure_model_with_a_plan_trains_as_one_process(runs: list[dict[str, Any]], reference: Any,
                                                                   name: str) -> None:  # fmt: skip
    for rank, results in enumerate(runs):
        assert_state_close(results[name]["state"], reference, rel=1e-5, what=f"{name}, rank {rank}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", SAVED_AFTER_FIT)
def test_left_sharded_after_fit_the_save_consolidates_to_the_one_process_model(
    runs: list[dict[str, Any]], reference: Any, workdir: Path, tmp_path: Path, name: str
) -> None:
    output = consolidate(workdir / f"{name}.ckpt", tmp_path / "model.safetensors", progress=False)
    state = {k.removeprefix("net."): v for k, v in load_file(str(output)).items()}
    assert_state_close(state, reference, rel=1e-5, what=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FITS))
def test_no_rank_held_the_whole_model(runs: list[dict[str, Any]], name: str) -> None:
    """The engine was built from the replay (not from values a rank held), and the replay kept less than half the
    model at once (each whole value from its last write to its hand-over, then freed)."""
    for rank, results in enumerate(runs):
        assert results[name]["built_sharded"], (name, rank)
        assert 0 < results[name]["replay_peak"] < _model_bytes() / 2, (name, rank, results[name]["replay_peak"])


@pytest.mark.timeout(600)
def test_a_parameter_initialized_after_the_plan_is_refused_by_name(runs: list[dict[str, Any]]) -> None:
    for results in runs:
        message = results["initialized_after_the_plan"]
        assert re.search(r"out\.weight was changed after the tensor-parallel plan distributed it.*Initialize the "
                         r"parameters before applying the plan", message), message
