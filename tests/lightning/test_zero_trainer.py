"""Real ``Trainer`` fits on 2 CPU ranks against DDP with the same seeds and data.

One fit per strategy through Lightning's spawn launcher (``zero1_spawn``, ``zero2_spawn``, ``zero3_spawn``) is shared
(module-scoped) by the tests that inspect it, against one DDP fit of the same module (in ``run_ranks`` ranks: the
reference is DDP's math, not its launcher, and a fork costs less than a spawned interpreter per rank). The model
has a tied embedding/output weight and a frozen middle block, uses ``accumulate_grad_batches=3`` with a partial last
window (7 batches per rank and epoch), gradient clipping by norm, ``self.log(..., sync_dist=True)``, a torchmetrics
metric and a validation loop. These are the suite's main coverage of the spawn launcher: the main process's module
after the fit, and files each spawned rank writes.

The tests whose point is not the launcher (``fit`` then ``test`` and ``predict`` at stage 3, a GAN under manual
optimization, LBFGS refused) run their fits in ``run_ranks`` ranks that Lightning takes for ranks torchrun
started, and read what each rank returns.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import lit
from helpers.launched import as_launched_rank
from helpers.lit import FROZEN, LitTiedLM, fit_lm, read_rank_files, state_of
from helpers.models import assert_state_close, lm_loss
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

SPAWN_NAMES = ["zero1_spawn", "zero2_spawn", "zero3_spawn"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Lazily fitted runs by strategy name: (model in the main process, trainer, per-rank output dir)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            out_dir = tmp_path_factory.mktemp(name)
            try:
                model, trainer = fit_lm(name, str(out_dir))
                cache[name] = (model, trainer, out_dir)
            except Exception as error:  # a failed fit fails every test using it, without fitting again
                cache[name] = error
        if isinstance(cache[name], Exception):
            pytest.fail(f"the {name} fit failed: {cache[name]!r}")
        return cache[name]

    return get


def _ddp_fit(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    as_launched_rank(rank, world_size)
    model, trainer = fit_lm("ddp", out_dir)
    return {"state": state_of(model), "metrics": {k: v.item() for k, v in trainer.callback_metrics.items()}}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> tuple[dict[str, Tensor], dict[str, float], Any]:
    """DDP's fit: rank 0's final state and logged metrics, and the directory its ranks wrote their files to."""
    out_dir = tmp_path_factory.mktemp("ddp")
    first = run_ranks(_ddp_fit, 2, str(out_dir), timeout_s=120)[0]
    return first["state"], first["metrics"], out_dir


@pytest.fixture(scope="module")
def initial_state():
    pl.seed_everything(0, verbose=False)
    return state_of(LitTiedLM())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", SPAWN_NAMES)
def test_fit_matches_ddp(runs, ddp, name):
    """After ``fit`` the main process's module holds full parameters equal to DDP's (accumulation with a partial
    window, clipping, tied and frozen weights included)."""
    ddp_state, _, ddp_dir = ddp
    norms = read_rank_files(ddp_dir, "train")[0]["grad_norms"]
    assert len(norms) == 6, "2 epochs x (3 + 3 + 1 micro-batches) must give 6 optimizer steps"
    assert min(norms) > 2 * lit.CLIP, "DDP must actually clip for the comparison to cover clipping"
    model, _, out_dir = runs(name)
    assert [r["reports"]["global_step"] for r in read_rank_files(out_dir, "train")] == [6, 6]
    assert_state_close(state_of(model), ddp_state, rel=1e-5, what=f"{name} vs ddp")
    for rank_file in read_rank_files(out_dir, "train"):  # zero_strategy.grad_norm before each step: DDP's
        assert rank_file["grad_norms"] == pytest.approx(norms, rel=1e-5), f"{name}: gradient norms before the step"


@pytest.mark.timeout(150)
def test_zero3_tied_and_frozen(runs, initial_state):
    model, _, _ = runs("zero3_spawn")
    assert model.net.head.weight is model.net.emb.weight
    state = state_of(model)
    for key, value in initial_state.items():
        if key.startswith(FROZEN + "."):
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=f"frozen {key} changed")
        else:
            assert not torch.equal(state[key], value), f"{key} did not train"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", SPAWN_NAMES)
def test_logging_is_synced_across_ranks(runs, ddp, name):
    """Each rank sees a different half of the data; the logged epoch values are global means, as under DDP."""
    _, trainer, _ = runs(name)
    _, ddp_metrics, _ = ddp
    metrics = trainer.callback_metrics
    global_mean = (lit.N_TRAIN - 1) / 2  # mean sample index over the whole data set
    rank0_mean = sum(range(0, lit.N_TRAIN, 2)) / (lit.N_TRAIN // 2)
    assert abs(global_mean - rank0_mean) >= 0.5  # the check below distinguishes synced from local
    assert metrics["idx_mean"].item() == pytest.approx(global_mean, abs=1e-6)
    assert metrics["idx_metric"].item() == pytest.approx(global_mean, abs=1e-6)
    for key in ("val_loss", "train_loss_epoch"):
        assert metrics[key].item() == pytest.approx(ddp_metrics[key], rel=1e-5), key


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", SPAWN_NAMES)
def test_each_rank_updates_its_own_tensors(runs, name):
    """A tensor attribute changed in place (as a torchmetrics state is) counts each rank's own 14 batches, and the
    main process's module is left alone: spawned ranks must not share it through shared memory."""
    model, _, out_dir = runs(name)
    assert [r["reports"]["batches_counted"] for r in read_rank_files(out_dir, "train")] == [14, 14]
    assert int(model.batches_counted) == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", SPAWN_NAMES)
def test_distributed_sampler_splits_the_data(runs, name):
    _, _, out_dir = runs(name)
    seen = [r["seen"] for r in read_rank_files(out_dir, "train")]
    for epoch in range(2):
        rank0, rank1 = set(seen[0][epoch]), set(seen[1][epoch])
        assert len(seen[0][epoch]) == len(seen[1][epoch]) == lit.N_TRAIN // 2
        assert not rank0 & rank1
        assert rank0 | rank1 == set(range(lit.N_TRAIN))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", SPAWN_NAMES)
def test_memory_and_communication_reports(runs, name):
    """The strategy's reports on each rank, held to ZeRO's numbers: Ψ_t trainable parameters (SGD momentum: 4Ψ_t
    of state, sharded), 14 micro-steps and 6 optimizer steps per rank."""
    model, _, out_dir = runs(name)
    stage = int(name[4])
    psi = sum(p.numel() for p in model.parameters())
    psi_t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    slack = 4 * 2 * 8  # padding: at most one element per unit and rank, 4 units, fp32, with margin
    for rank, r in enumerate(read_rank_files(out_dir, "train")):
        params, grads, state = r["reports"]["memory"]
        assert abs(state - 4 * psi_t / 2) <= slack, (rank, state, 4 * psi_t / 2)
        assert abs(grads - 4 * psi_t / 2) <= slack, (rank, grads)
        expected_params = 4 * psi / 2 if stage == 3 else 4 * psi
        assert abs(params - expected_params) <= slack, (rank, params, expected_params)
        comm = r["reports"]["communication"]
        micro_steps, steps = 14, 6
        rs_expected = (steps if stage == 1 else micro_steps) * 4 * psi_t
        assert rs_expected <= comm["reduce_scatter"] <= rs_expected * 1.02, (rank, comm, rs_expected)
        # stage 3 params hold no storage on the module at the end of training (teardown has not run yet)
        if stage == 3:
            assert r["reports"]["param_storage_bytes"] == 0


def fit_then_test_and_predict(rank: int, world: int) -> dict[str, Any]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK): a DDP fit, then a
    zero3 fit followed by ``test`` and ``predict`` on the same Trainer."""
    as_launched_rank(rank, world)
    ddp_model, _ = fit_lm("ddp", None, devices=world)
    model, trainer = fit_lm("zero3", None, devices=world)
    results = trainer.test(model, lit.test_loader(), verbose=False)
    trainer.predict(model, lit.test_loader())
    return {"ddp": state_of(ddp_model), "test": results, "predictions": model.predictions, "after": state_of(model)}


@pytest.mark.timeout(120)  # two fits, a test and a predict on 2 ranks: 0.9 s measured
def test_zero3_fit_then_test_and_predict() -> None:
    """``fit`` then ``test`` and ``predict`` on the same Trainer at stage 3: results equal a plain module with the
    fitted weights."""
    runs = run_ranks(fit_then_test_and_predict, 2, timeout_s=100)
    reference = LitTiedLM()
    reference.load_state_dict(runs[0]["ddp"])
    tokens = lit.test_loader().dataset.tokens
    with torch.no_grad():
        expected_loss = lm_loss(reference.net, tokens).item()
        expected_logits = reference.net(tokens)

    for rank, run in enumerate(runs):
        results = run["test"]
        assert results[0]["test_loss"] == pytest.approx(expected_loss, rel=1e-5), f"rank {rank}"
        assert results[0]["test_idx_mean"] == pytest.approx((lit.N_TEST - 1) / 2, abs=1e-6), f"rank {rank}"

    seen = []
    for rank, run in enumerate(runs):
        predictions = run["predictions"]
        assert predictions, f"rank {rank} predicted nothing"
        for idx, logits in predictions:
            torch.testing.assert_close(logits, expected_logits[idx], rtol=1e-5, atol=1e-5)
            seen.extend(idx.tolist())
    assert sorted(seen) == list(range(lit.N_TEST))  # each rank predicted its own half

    for rank, run in enumerate(runs):  # testing and predicting did not change the weights
        assert_state_close(run["after"], run["ddp"], rel=1e-5, what=f"rank {rank}, after test/predict")


GAN_STRATEGIES = {
    "ddp": lambda: DDPStrategy(find_unused_parameters=True),
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
}


def fit_gans(rank: int, world: int) -> dict[str, dict[str, Tensor]]:
    """On one rank (launched by run_ranks as torchrun would launch it): the GAN's final weights under DDP and under
    each ZeRO stage, fitted one after another from the same seed."""
    as_launched_rank(rank, world)
    return {name: lit.fit_gan(make()) for name, make in GAN_STRATEGIES.items()}


@pytest.fixture(scope="module")
def gan_runs() -> list[dict[str, dict[str, Tensor]]]:
    return run_ranks(fit_gans, 2, timeout_s=100)


@pytest.mark.timeout(120)  # the first one runs the 3 fits on 2 ranks: 0.4 s measured
@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_manual_optimization_gan_matches_ddp(gan_runs: list[dict[str, dict[str, Tensor]]], name: str) -> None:
    """A GAN-like module (manual optimization, two optimizers, toggle_optimizer) matches DDP."""
    for rank, run in enumerate(gan_runs):
        assert_state_close(run[name], run["ddp"], rel=1e-5, what=f"GAN, rank {rank}, {name} vs ddp")


def fit_with_lbfgs(rank: int, world: int) -> str:
    """On one rank (launched by run_ranks as torchrun would launch it): the error a zero2 fit with LBFGS raises."""
    as_launched_rank(rank, world)
    try:
        fit_lm(ZeroStrategy(stage=2), None, lit.LitTiedLMWithLBFGS, devices=world, max_epochs=1)
    except Exception as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(60)  # one rank, refused at setup: 0.1 s measured
def test_lbfgs_refused_with_clear_error() -> None:
    [message] = run_ranks(fit_with_lbfgs, 1, timeout_s=50)
    assert re.search(r"cannot shard optimizer torch\.optim\.lbfgs\.LBFGS", message), message
