"""Through the Trainer, ``p.grad`` reads as under DDP: in ``on_after_backward`` (this rank's own sum mid-window, the
average at the window's end), ``on_before_optimizer_step`` (Lightning's own ``grad_norm``), a
``configure_gradient_clipping`` that calls torch's ``clip_grad_norm_(self.parameters(), ...)`` (what it clipped is
what the step uses: the weights equal DDP's), after a validation inside an accumulation window (the gradients held
so far are intact), in a ``rank_zero_only`` callback (no rank waits), and under manual optimization after
``manual_backward`` (summed by hand, clipped by hand, and still there after ``opt.step()``). DDP runs in the same
launch; zero1/2/3, stage 3 on one host's shared memory and on ``collectives="point_to_point"``; 1 and 2 processes.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers.compare import assert_state_close, assert_values_close
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.lit_grad_reads import ComparesNorms, ManualGradients, RankZeroGradientLogger, ReadsGradients
from torch import Tensor

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: ZeroStrategy(stage=3, collectives="auto"),
    "zero3_point_to_point": lambda: ZeroStrategy(stage=3, collectives="point_to_point"),
}
BATCHES = 6  # accumulation over 2: three steps; validation after the third batch, inside the second window


def _fit(module: pl.LightningModule, strategy: Any, world: int, **kwargs: Any) -> dict[str, Tensor]:
    logger = RankZeroGradientLogger()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_train_batches=BATCHES, callbacks=[logger], **kwargs)
    trainer.fit(module, loader(4 * BATCHES * world, 21), loader(4 * 2 * world, 22))
    flat: dict[str, Tensor] = {f"final/{k}": v.detach().clone() for k, v in module.state_dict().items()}
    for kind, records in module.seen.items():  # type: ignore[union-attr]
        for index, record in enumerate(records):
            values = record if isinstance(record, dict) else {"": record}
            flat |= {f"{kind}/{index}/{name}": value for name, value in values.items()}
    flat |= {f"rank_zero_norm/{index}": value for index, value in enumerate(logger.norms)}
    return flat


def fit_each(rank: int, world: int) -> dict:
    """On one rank (launched as torchrun would: Lightning sees LOCAL_RANK), DDP then every ZeRO strategy, each
    fitting the same two modules on the same data."""
    as_launched_rank(rank, world)
    out: dict = {}
    for name, make in {"ddp": lambda: "ddp", **STRATEGIES}.items():
        pl.seed_everything(0, verbose=False)
        automatic = _fit(ReadsGradients(), make(), world, accumulate_grad_batches=2, val_check_interval=3,
                         limit_val_batches=2)
        pl.seed_everything(0, verbose=False)
        manual = _fit(ManualGradients(), make(), world, limit_val_batches=0)
        out[name] = {"automatic": automatic, "manual": manual}
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(fit_each, request.param, timeout_s=400)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("module", ["automatic", "manual"])
def test_gradient_reads_match_ddp(runs: list[dict], strategy: str, module: str) -> None:
    for rank, result in enumerate(runs):
        ddp, got = result["ddp"][module], result[strategy][module]
        assert got.keys() == ddp.keys(), f"rank {rank}: {sorted(set(got) ^ set(ddp))}"
        if module == "automatic":  # what the comparison needs was recorded
            assert any(key.startswith("after_validation/1/") for key in ddp)  # 0: the sanity check, before any
            assert any(key.startswith("clip/2/") for key in ddp) and "norms/2/grad_2.0_norm_total" in ddp
            assert any(key.startswith("rank_zero_norm/") for key in ddp) == (rank == 0)
        assert_state_close(got, ddp, rel=1e-5, what=f"rank {rank}, {strategy}, {module}")


def norms_each(rank: int, world: int, precision: str) -> dict[str, list]:
    as_launched_rank(rank, world)
    out: dict[str, list] = {}
    for name, make in STRATEGIES.items():
        pl.seed_everything(0, verbose=False)
        module = ComparesNorms()
        trainer = pl.Trainer(strategy=make(), accelerator="cpu", devices=world, max_steps=3, logger=False,
                             precision=precision, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accumulate_grad_batches=2)
        trainer.fit(module, loader(4 * 6 * world, 21))
        out[name] = module.pairs
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_p_grad_is_unscaled_in_on_before_optimizer_step(precision: str) -> None:
    for rank, runs in enumerate(run_ranks(norms_each, 2, precision, timeout_s=300)):
        for strategy, pairs in runs.items():
            assert pairs, strategy
            compared = 0
            for step, (lightnings, ours) in enumerate(pairs):
                where = f"rank {rank}, {strategy}, {precision}, step {step}"
                assert lightnings.keys() == ours.keys(), where
                if not all(math.isfinite(v) for v in lightnings.values()):  # fp16: a step the loss scale skips
                    # runs the hook too, as Lightning's DDP does: both read the same non-finite gradients
                    assert [math.isfinite(v) for v in lightnings.values()] == [
                        math.isfinite(v) for v in ours.values()], where
                    continue
                assert_values_close(list(lightnings.values()), list(ours.values()), rel=1e-5, what=where)
                compared += 1
            assert compared > 0, f"{strategy}: no finite step was compared"
