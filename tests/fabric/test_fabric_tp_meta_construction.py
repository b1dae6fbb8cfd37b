"""Fabric: a ToyNet built under ``fabric.init_module(empty_init=True)`` (on the meta device, recorded) and set up by
``ZeroFabricStrategy(tensor_parallel_size=2, parallelize_fn=fn)`` trains on 4 CPU ranks (2 data-parallel x 2
tensor-parallel) as one process trains the same network built eagerly (``tp_toy.reference_states``): the plan is
applied inside the continued recording and each rank keeps its TP block and ZeRO range of every replayed value
(issue 36). Stages 1 and 3, stage 3 on one host's shared memory and on the network path, in one launch."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from helpers.tp_toy import Tokens, ToyNet, apply_plan, full_state, loss_of, make_model, reference_states
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from zero_strategy import ZeroFabricStrategy
from zero_strategy.testing import run_ranks

WORLD, TP, ROWS, STEPS, LR, CLIP, SAMPLES = 4, 2, 2, 3, 1e-2, 0.5, 64  # ROWS per data-parallel rank and step
ZERO = {
    "zero1": dict(stage=1),
    "zero3": dict(stage=3, collectives="auto", full_params_after_fit=True),
    "zero3_point_to_point": dict(stage=3, collectives="point_to_point", full_params_after_fit=True),
}


def parallelize(model: ToyNet, mesh: Any) -> ToyNet:
    apply_plan(model, mesh["tensor_parallel"])
    return model


def train_each(rank: int, world: int) -> dict[str, Any]:
    as_launched_rank(rank, world)
    out: dict[str, Any] = {}
    for name, options in ZERO.items():
        strategy = ZeroFabricStrategy(**options, tensor_parallel_size=TP, parallelize_fn=parallelize,
                                      process_group_timeout_s=120.0)
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision="32-true")
        fabric.launch()
        with fabric.init_module(empty_init=True):
            built = make_model()  # seed 0, then ToyNet(), as the reference's eager build
        was_meta = all(p.is_meta for p in built.parameters())
        model = fabric.setup_module(built)
        built_sharded = fabric.strategy.engine().built_sharded  # the engine setup_module built from the replay
        optimizer: Any = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        fabric.seed_everything(0)  # the sampler's shuffle seed, the one global_batch assumes
        loader = fabric.setup_dataloaders(DataLoader(Tokens(SAMPLES), batch_size=ROWS, shuffle=True))
        for batch in itertools.islice(loader, STEPS):
            fabric.backward(loss_of(model, batch))
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
        engine = fabric.strategy.engine()
        out[name] = {"was_meta": was_meta, "built_sharded": built_sharded}
        engine.release()
        out[name]["state"] = full_state(model)
        fabric.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(train_each, WORLD, timeout_s=600, pg_timeout_s=120)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(ZERO))
def test_built_on_the_meta_device_with_a_parallelize_fn_trains_as_one_process(runs: list[dict[str, Any]],
                                                                               name: str) -> None:  # fmt: skip
    reference = reference_states(STEPS, ROWS * WORLD // TP, lr=LR, clip=CLIP)
    assert len(reference) == len(make_model().state_dict())
    for rank, result in enumerate(runs):
        assert result[name]["was_meta"] and result[name]["built_sharded"], (rank, name)
        assert_state_close(result[name]["state"], reference, rel=1e-5, what=f"rank {rank} {name}")
