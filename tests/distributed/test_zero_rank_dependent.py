"""Ranks that use different parameters in a step (mixture-of-experts routing): parity with
DDP(find_unused_parameters=True) at every stage, with the experts as separate units and as one unit."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.models import assert_state_close, clone_state
from helpers.moe import make_moe, train_moe
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.core.comm.watch import DivergedGathersError
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks

UNIT_CHOICES = {"separate": [], "one_unit": ["ModuleList"]}


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _ddp_run(rank: int, world_size: int, kind: str) -> dict[str, torch.Tensor]:
    model = make_moe()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    train_moe(ddp, model, _optimizer(kind, model.parameters()), rank, world_size)
    return clone_state(model)


def _zero_run(
    rank: int, world_size: int, kind: str, stage: int, units: str, collectives: str = "auto"
) -> dict[str, torch.Tensor]:
    model = make_moe()
    optimizer = _optimizer(kind, model.parameters())
    config = ZeroConfig(stage=stage, unit_modules=UNIT_CHOICES[units], collectives=collectives)
    engine = ZeroEngine(model, [optimizer], config)
    if units == "one_unit":
        assert [u.name for u in engine.units] == ["", "experts"]
    else:
        assert "experts.1" in [u.name for u in engine.units]
    train_moe(model, model, optimizer, rank, world_size,
              lambda: engine.optimizer_step(optimizer))
    with engine.gathered_parameters():
        return clone_state(model)


def _all_runs(rank: int, world_size: int, kind: str, stages: tuple[int, ...]) -> dict:
    results: dict = {"ddp": _ddp_run(rank, world_size, kind)}
    for stage in stages:
        # AdamW's step counter is one per master piece, so experts sharing one unit's piece cannot match DDP's
        # per-tensor counters exactly (a warning says so); SGD covers the one-unit layout.
        for units in UNIT_CHOICES if kind == "sgd" else ["separate"]:
            results[(stage, units)] = _zero_run(rank, world_size, kind, stage, units)
    if kind == "sgd":
        # Stage 3 gathers through the network instead of shared memory: with the experts one unit every rank gathers
        # it whichever experts it routes to, so gathers still pair up.
        results[(3, "one_unit", "point_to_point")] = _zero_run(rank, world_size, kind, 3, "one_unit", "point_to_point")
        # gloo's own collectives pair by issue order alone: reductions issued in one agreed order keep them paired
        results[(2, "separate", "native")] = _zero_run(rank, world_size, kind, 2, "separate", "native")
    return results


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("world_size", "kind"), [(2, "sgd"), (2, "adamw"), (4, "sgd")])
def test_rank_dependent_routing_matches_ddp(world_size: int, kind: str) -> None:
    """Every rank routes to its own experts, some steps leave an expert unused by every rank: the weights end where
    DDP(find_unused_parameters=True) puts them (AdamW with weight decay would move an expert stepped by mistake)."""
    initial = clone_state(make_moe())
    results = run_ranks(_all_runs, world_size, kind, (1, 2, 3), timeout_s=80)
    reference = results[0]["ddp"]
    assert not torch.equal(reference["experts.2.fc.weight"], initial["experts.2.fc.weight"])  # it trained
    for rank, runs in enumerate(results):
        for key, state in runs.items():
            if key != "ddp":
                assert_state_close(state, reference, rel=1e-5, what=f"rank {rank}, world {world_size}, {key}")


class _Scaled(nn.Module):
    """A block with a buffer, so that a root without parameters still has buffers to keep in step."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * self.scale


class _ParameterlessRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Scaled(5) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _parameterless_root_run(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _ParameterlessRoot()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3))
    prefetches = []
    for unit in engine.units:  # a unit's own start_unshard is only called to prefetch it
        unit.start_unshard = lambda unit=unit, original=unit.start_unshard: (prefetches.append(unit.name), original())
    buffers_seen = []
    for step in range(3):
        for block in model.blocks:
            block.scale.fill_(1.0 + rank + step)  # each rank drifts; DDP puts rank 0's values back each forward
        prefetches.clear()
        loss = model(torch.ones(2, 5) * (rank + 1)).square().mean()
        forward_prefetches = list(prefetches)
        buffers_seen.append([float(block.scale) for block in model.blocks])
        loss.backward()
        engine.optimizer_step(optimizer)
    return {"units": [u.name for u in engine.units], "buffers": buffers_seen, "prefetched": forward_prefetches}


@pytest.mark.timeout(60)
def test_root_without_parameters_syncs_buffers_and_prefetches() -> None:
    """The root stores no parameter (so it is no unit): buffers still follow rank 0 before every training forward,
    and once the first forward recorded the order, each block's forward prefetches the next."""
    results = run_ranks(_parameterless_root_run, 2, timeout_s=50)
    for rank, result in enumerate(results):
        assert "" not in result["units"], result["units"]
        assert result["buffers"] == [[1.0 + step] * 3 for step in range(3)], f"rank {rank}: {result['buffers']}"
    for rank, result in enumerate(results):
        # blocks.0 prefetches blocks.1, blocks.1 prefetches blocks.2 (the end of the root's forward may ask for
        # blocks.2, the first unit backward needs, again: a no-op, it is still whole)
        assert result["prefetched"][:2] == ["blocks.1", "blocks.2"], f"rank {rank}: {result['prefetched']}"


def _network_divergence_run(rank: int, world_size: int, collectives: str) -> str:
    model = make_moe()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, collectives=collectives))
    assert not engine.comms.host_shared  # gathers go through the network
    start = time.monotonic()
    try:
        train_moe(model, model, optimizer, rank, world_size,
                  lambda: engine.optimizer_step(optimizer))
    except DivergedGathersError as error:
        return f"{time.monotonic() - start:.1f} {error}"
    return "trained"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collectives", ["point_to_point", "native"])
def test_network_gathers_of_different_units_fail_fast_on_every_rank(collectives: str) -> None:
    """Stage 3 through the network, each expert its own unit, each rank routing to another expert: the ranks gather
    different units. Point-to-point gathers would wait forever (and, being the same size, experts' gathers would
    pair up with each other's bytes): every rank raises within seconds, well before the process group's timeout,
    naming the units and the remedy; "native" collectives pair equal-sized gathers without waiting, so the step
    is refused instead."""
    results = run_ranks(_network_divergence_run, 2, collectives, timeout_s=50, pg_timeout_s=40)
    for rank, result in enumerate(results):
        assert result != "trained", f"rank {rank} trained on mismatched gathers"
        seconds, message = result.split(" ", 1)
        assert float(seconds) < 15, f"rank {rank} took {seconds} s to fail"
        assert "unit_modules" in message and "shared_memory" in message, message
        if collectives == "point_to_point":
            assert "'experts.0' on rank 0, 'experts.1' on rank 1" in message, message
