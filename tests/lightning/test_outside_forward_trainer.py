"""The Trainer reading and changing parameters outside forward as code written for DDP does (issue 34, items 2 and
7): ``before = w.clone()`` in training_step and the step's difference after it, a weight's norm in a hook, in-place
changes every rank makes and a load_state_dict into the running model, at every stage (stage 3 on one host's shared
memory and through the network; with offload), on 1 and 2 processes, against DDP in the same test. A read only
rank 0 makes answers on shared memory and stops both ranks with an error naming the parameter through the network
(see [Note: parameters outside forward] in core/flat/access.py)."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.lit_outside import RankZeroRead, ReadsAndChanges, seen_tensors

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: ZeroStrategy(stage=3, collectives="auto"),
    "zero3_point_to_point": lambda: ZeroStrategy(stage=3, collectives="point_to_point"),
    # offload: masters apart from the parameters (stage 2 takes changes in at the step), stage 3 through the network
    "zero2_offload": lambda: "zero2_offload",
    "zero3_offload": lambda: "zero3_offload",
}


def _trainer(strategy: object, world: int) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=4, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def fit_each(rank: int, world: int) -> dict:
    """DDP then every ZeRO strategy, each fitting the same module on the same data (launched as torchrun would)."""
    as_launched_rank(rank, world)
    out = {}
    for name, make in {"ddp": lambda: "ddp", **STRATEGIES}.items():
        pl.seed_everything(0, verbose=False)
        module = ReadsAndChanges()
        _trainer(make(), world).fit(module, loader(4 * 4 * world, 21))
        out[name] = seen_tensors(module)
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(fit_each, request.param, timeout_s=400)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_reads_and_changes_outside_forward_match_ddp(runs: list[dict], strategy: str) -> None:
    for rank, result in enumerate(runs):
        assert len([k for k in result["ddp"] if k.startswith("delta/")]) == 4, "every step recorded"
        assert_state_close(result[strategy], result["ddp"], rel=1e-5, what=f"rank {rank}")


def rank_zero_read(rank: int, world: int, strategy: str) -> dict:
    as_launched_rank(rank, world)
    out: dict = {}
    for name, make in (("ddp", lambda: "ddp"), (strategy, STRATEGIES[strategy])):
        pl.seed_everything(0, verbose=False)
        module = RankZeroRead()
        started = time.monotonic()
        try:
            _trainer(make(), world).fit(module, loader(4 * 4 * world, 21))
            out[name] = seen_tensors(module)
        except Exception as error:  # what each rank sees
            out[name] = f"{type(error).__name__}: {error}"
        out[f"{name}_seconds"] = time.monotonic() - started
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3", "zero3_point_to_point"])
def test_a_read_only_rank_zero_makes(strategy: str) -> None:
    results = run_ranks(rank_zero_read, 2, strategy, timeout_s=250)
    if strategy == "zero3":  # shared memory: read in place, DDP's values, and the fit goes on
        for rank, result in enumerate(results):
            assert_state_close(result[strategy], result["ddp"], rel=1e-5, what=f"rank {rank}")
        return
    for rank, result in enumerate(results):  # the network: both ranks stop, naming the parameter, within seconds
        outcome = result[strategy]
        assert isinstance(outcome, str) and "net.blocks.1.fc.weight" in outcome, f"rank {rank}: {outcome}"
        assert "gathered_parameters()" in outcome, outcome
        assert result[f"{strategy}_seconds"] < 60, result[f"{strategy}_seconds"]
