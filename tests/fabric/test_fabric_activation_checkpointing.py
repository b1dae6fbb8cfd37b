"""``activation_checkpointing`` under Fabric, as under the Trainer: the selected blocks' forwards are checkpointed
from set-up until teardown (each runs again in backward), and training ends on the weights of the same run without
checkpointing — at stages 1 and 3, stage 3 on one host's shared memory and on point-to-point, on 2 ranks. The
option takes class names (what a config file holds) or classes, with or without ``cpu_checkpointing``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.fabric_runs import Net, train, weights
from helpers.launched import as_launched_rank
from helpers.litgpt_runs import make_fabric
from helpers.models import assert_state_close
from torch import nn

from zero_strategy import ZeroFabricStrategy
from zero_strategy.testing import run_ranks

STEPS = 2
ACCUMULATION = 2
CASES = {  # name: (stage, collectives)
    "zero1": (1, "auto"),
    "zero3": (3, "auto"),
    "zero3_point_to_point": (3, "point_to_point"),
}
CHECKPOINTING = {  # name: the ZeroFabricStrategy options that turn it on
    "by_name": {"activation_checkpointing": ["Sequential"]},
    "by_class_to_cpu": {"activation_checkpointing": [nn.Sequential], "cpu_checkpointing": True},
}


def _run(world: int, stage: int, collectives: str, options: dict[str, Any]) -> dict[str, Any]:
    """STEPS steps of AdamW on Net; how often the first block's Linear ran, and how many forwards were wrapped
    after set-up and after teardown."""
    fabric = make_fabric(ZeroFabricStrategy(stage=stage, collectives=collectives, **options), world)
    fabric.seed_everything(0)
    net = Net()
    forwards = [0]
    # on a layer inside the first block: the recomputation calls the block's own forward, which calls the layer
    net.blocks[0][1].register_forward_pre_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.02))
    wrapped_in_run = sum(hasattr(m, "_zero_original_forward") for m in net.modules())
    train(fabric, model, [optimizer], STEPS, accumulation=ACCUMULATION)
    out = {"weights": weights(model), "forwards": forwards[0], "wrapped_in_run": wrapped_in_run}
    fabric.strategy.teardown()
    out["wrapped_after"] = sum(hasattr(m, "_zero_original_forward") for m in net.modules())
    return out


def each_case(rank: int, world: int) -> dict:
    as_launched_rank(rank, world)
    return {(case, how): _run(world, stage, collectives, options)
            for case, (stage, collectives) in CASES.items()
            for how, options in {"plain": {}, **CHECKPOINTING}.items()}


@pytest.mark.timeout(120)  # measured: 2 s
def test_checkpointed_blocks_recompute_in_backward_and_train_the_same_weights() -> None:
    results = run_ranks(each_case, 2, timeout_s=100)
    micro_steps = STEPS * ACCUMULATION
    for rank, got in enumerate(results):
        for case in CASES:
            plain = got[(case, "plain")]
            assert (plain["forwards"], plain["wrapped_in_run"]) == (micro_steps, 0), (rank, case)
            for how in CHECKPOINTING:
                run = got[(case, how)]
                what = f"rank {rank}, {case}, {how}"
                assert run["wrapped_in_run"] == len(Net().blocks), f"{what}: every block's forward is checkpointed"
                assert run["forwards"] == 2 * micro_steps, f"{what}: each block runs again in backward"
                assert run["wrapped_after"] == 0, f"{what}: teardown gives the blocks their own forward back"
                assert_state_close(run["weights"], plain["weights"], rel=0.0, what=what)
