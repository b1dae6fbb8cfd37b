"""Lightning patterns under ZeRO against DDP: a manual step with two forwards and two backwards, a parameter read after
the step (inside gathered_parameters), state_dict() inside the step, a deep copy of the network at fit start — at
every stage, stage 3 on both transports (one host's shared memory, and point-to-point: the path of GPUs and several
nodes), on 1 and 2 processes. A plain read of a stage-3 parameter outside forward, made by every rank, gives DDP's
values (see [Note: parameters outside forward] in core/flat/access.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers.compare import assert_values_close
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.lit_patterns import Patterns, patterns_result, tensors_of

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: ZeroStrategy(stage=3, collectives="auto"),
    "zero3_point_to_point": lambda: ZeroStrategy(stage=3, collectives="point_to_point"),
}


def fit_each(rank: int, world: int) -> dict:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK), DDP then every
    ZeRO strategy, each fitting the same model on the same data for 3 steps."""
    as_launched_rank(rank, world)
    out = {}
    for name, make in {"ddp": lambda: "ddp", **STRATEGIES}.items():
        pl.seed_everything(0, verbose=False)
        module = Patterns()
        trainer = pl.Trainer(strategy=make(), accelerator="cpu", devices=world, max_steps=3, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, loader(4 * 3 * world, 21))
        out[name] = patterns_result(module)
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(fit_each, request.param, timeout_s=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_patterns_match_ddp(runs: list[dict], strategy: str) -> None:
    for rank, result in enumerate(runs):
        ddp, got = tensors_of(result["ddp"]), tensors_of(result[strategy])
        assert got.keys() == ddp.keys(), f"rank {rank}: {sorted(set(got) ^ set(ddp))}"
        for key, value in ddp.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_plain_read_outside_forward(runs: list[dict], strategy: str) -> None:
    for result in runs:  # every rank reads: DDP's values at every stage (stage 3 reads in place or gathers)
        ddp_reads, reads = result["ddp"]["seen"]["outside_read"], result[strategy]["seen"]["outside_read"]
        assert all(isinstance(r, float) for r in reads), reads
        assert_values_close(reads, ddp_reads, rel=1e-5, what=strategy)
