"""Fabric reading and changing parameters outside forward as code written for DDP does (issue 34, items 2 and 7):
``before = w.clone()`` and the step's difference, in-place changes every rank makes (``mul_``, ``p[i] = v``, a
re-initialisation, ``load_state_dict`` into the running model), at every stage (stage 3 on one host's shared memory
and through the network), on 1 and 2 processes, against Fabric's DDP in the same run; and a read only rank 0 makes
(see [Note: parameters outside forward] in core/flat/access.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.fabric_runs import Net, train, weights
from helpers.launched import as_launched_rank
from helpers.litgpt_runs import make_fabric

from zero_strategy import ZeroFabricStrategy
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3, collectives="auto"),
    "zero3_point_to_point": dict(stage=3, collectives="point_to_point"),
    "zero2_offload": dict(stage=2, offload_optimizer="cpu"),  # masters apart: changes taken in at the step
    "zero3_offload": dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
}


def _strategy(name: str) -> Any:
    return "ddp" if name == "ddp" else ZeroFabricStrategy(**STRATEGIES[name])


def reads_and_changes(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    as_launched_rank(rank, world)
    out = {}
    for name in ("ddp", *STRATEGIES):
        fabric = make_fabric(_strategy(name), world)
        fabric.seed_everything(0)
        model = Net()
        loaded = {k: v.detach().clone() for k, v in Net().state_dict().items()}  # another model's weights
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
        weight = model.blocks[1][1].weight
        seen: dict[str, torch.Tensor] = {}
        for step in range(3):
            before = weight.clone()  # every rank, before the step: DDP's values
            train(fabric, model, [optimizer], 1, first_step=step)
            seen[f"delta/{step}"] = (weight - before).detach()
            seen[f"norm/{step}"] = weight.norm().detach()
            with torch.no_grad():  # every rank changes the weights, as DDP code does
                if step == 0:
                    weight.mul_(0.5)
                    model.blocks[2][1].bias[1] = -0.5
                if step == 1:
                    torch.manual_seed(7)
                    model.blocks[0][1].reset_parameters()
            if step == 1:
                model.load_state_dict(loaded)
        out[name] = seen | {f"final/{k}": v for k, v in weights(model).items()}
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(reads_and_changes, request.param, timeout_s=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_reads_and_changes_outside_forward_match_fabric_ddp(runs: list[dict], name: str) -> None:
    for rank, result in enumerate(runs):
        assert_state_close(result[name], result["ddp"], rel=1e-5, what=f"rank {rank}")


def rank_zero_read(rank: int, world: int, name: str) -> dict[str, Any]:
    as_launched_rank(rank, world)
    fabric = make_fabric(_strategy(name), world)
    fabric.seed_everything(0)
    reference = Net()
    fabric.seed_everything(0)
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        if rank == 0:  # e.g. a logging helper under rank_zero_only
            out["read"] = model.blocks[1][1].weight.detach().clone()
            out["reference"] = reference.blocks[1][1].weight.detach().clone()
        train(fabric, model, [optimizer], 1)
        out["outcome"] = "trained"
    except Exception as error:  # what each rank sees
        out["outcome"] = f"{type(error).__name__}: {error}"
    out["seconds"] = time.monotonic() - started
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero3", "zero3_point_to_point"])
def test_a_read_only_rank_zero_makes(name: str) -> None:
    results = run_ranks(rank_zero_read, 2, name, timeout_s=250)
    if name == "zero3":  # shared memory: read in place, DDP's values, and training goes on
        torch.testing.assert_close(results[0]["read"], results[0]["reference"], rtol=0, atol=0)
        assert [r["outcome"] for r in results] == ["trained", "trained"]
        return
    for result in results:  # the network: both ranks stop within seconds, naming the parameter
        assert "blocks.1.1.weight" in result["outcome"] and "gathered_parameters()" in result["outcome"], result
        assert result["seconds"] < 60, result["seconds"]
