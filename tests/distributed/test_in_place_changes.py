"""In-place changes to module parameters outside the optimizer: where ZeRO would lose them, the run says so (naming
the parameter) and the change is indeed gone; where it keeps them (stages 1/2 in fp32), it keeps them like DDP and
says nothing; training alone never warns."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.models import lm_loss, make_batches, make_model, rank_slice

from zero_strategy import InPlaceChangeWarning
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.testing import run_ranks

CHANGED = "blocks.1.fc.weight"


def change_worker(rank, world_size, stage, bf16, change):
    """Two steps with accumulation; after the first, every rank halves one weight (``change``). The optimizer is SGD
    with lr=0, so a step moves nothing: what the weight holds after the second step is the change, or its loss."""
    model = make_model(n_blocks=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    config = ZeroConfig(stage=stage, collectives="point_to_point")  # stage 3: gathers through the network
    engine = ZeroEngine(model, [optimizer], config, policy=policy)
    weight = model.blocks[1].fc.weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, micro_batches in enumerate(make_batches(2, 2, 8)):
            optimizer.zero_grad()
            for tokens in micro_batches:
                lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
            engine.optimizer_step(optimizer)
            if change and step == 0:
                with engine.gathered_parameters(), torch.no_grad():  # stage 3: whole only inside this block
                    before = weight.detach().float().clone()
                    weight.mul_(0.5)
        with engine.gathered_parameters():
            after = weight.detach().float().clone()
    engine.release()
    messages = [str(w.message) for w in caught if issubclass(w.category, InPlaceChangeWarning)]
    return {"messages": messages, "kept": bool(torch.equal(after, before * 0.5)) if change else None,
            "lost": bool(torch.equal(after, before)) if change else None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "bf16", "lost", "phrase"),
    [(3, False, True, "lost when its unit is released"), (2, True, True, "next optimizer step overwrites"),
     (1, False, False, None)],
)
def test_an_in_place_change_is_named_where_it_is_lost_and_kept_where_ddp_keeps_it(stage, bf16, lost, phrase):
    changed = run_ranks(change_worker, 2, stage, bf16, True, timeout_s=100)
    for rank, result in enumerate(changed):
        if lost:
            assert result["lost"], f"rank {rank}: the change was expected to be gone"
            assert len(result["messages"]) == 1, f"rank {rank}: {result['messages']}"
            assert CHANGED in result["messages"][0] and phrase in result["messages"][0], result["messages"][0]
        else:  # each rank's slice is its master shard: the change every rank made stays, as under DDP
            assert result["kept"] and result["messages"] == [], f"rank {rank}: {result}"
    untouched = run_ranks(change_worker, 2, stage, bf16, False, timeout_s=100)
    assert [result["messages"] for result in untouched] == [[], []]  # gathers, steps, accumulation: no warning
