"""Sharded construction: a model built on the meta device and materialized unit by unit equals the same model
built eagerly with the same seed — bit for bit after init (and the generator ends where the eager build leaves
it), and after SGD steps within 1e-5 of the eagerly built model trained under DDP — at every stage and world size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.meta_models import build
from helpers.models import clone_state, lm_loss, make_batches, rank_slice
from helpers.storage_meter import StoragePeakMeter

from zero_strategy.config import ZeroConfig
from zero_strategy.core.deferred import ReplayPlan, record_construction
from zero_strategy.core.materialize import InitialValues, UnmaterializedError
from zero_strategy.core.step.engine import ZeroEngine
from zero_strategy.testing import run_ranks

STEPS, GLOBAL_BATCH, SEED, LR = 3, 8, 5, 0.3


def _train(model, step, rank: int, world_size: int) -> None:
    for (tokens,) in make_batches(STEPS, 1, GLOBAL_BATCH):
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        step()


def _meter_replays(peaks: list[int]) -> None:
    """From now on in this (forked) rank, every replay runs under a StoragePeakMeter, which appends the peak bytes
    of the storages created while it ran — the replay's own and what the FlatParams allocate to take each value."""
    replay = ReplayPlan.replay

    def metered(self: ReplayPlan, on_final: Any) -> Any:
        with StoragePeakMeter() as meter:
            stats = replay(self, on_final)
        peaks.append(meter.peak_bytes)
        return stats

    ReplayPlan.replay = metered  # type: ignore[method-assign]


def meta_worker(rank: int, world_size: int, stage: int, kind: str) -> dict:
    torch.manual_seed(SEED + rank)  # every rank adopts rank 0's generator state, as DDP adopts its values
    if rank == 0:
        torch.manual_seed(SEED)
    with record_construction() as recording:
        model = build(kind)
    assert all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    peaks: list[int] = []
    _meter_replays(peaks)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage), initial_values=InitialValues(recording))
    with engine.gathered_parameters():
        initial = clone_state(model)
    out = {"initial": initial, "rng_after_init": torch.get_rng_state(), "peaks": peaks}

    def step() -> None:
        engine.optimizer_step(optimizer)
        optimizer.zero_grad()

    _train(model, step, rank, world_size)
    with engine.gathered_parameters():
        out["trained"] = clone_state(model)
    out["ddp"] = _ddp_trained(kind, rank, world_size)
    return out


def _ddp_trained(kind: str, rank: int, world_size: int) -> dict:
    """The reference: the model built eagerly (rank 0's seed; DDP broadcasts rank 0's values) trained by DDP."""
    torch.manual_seed(SEED)
    model = build(kind)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    _train(ddp, step, rank, world_size)
    return clone_state(model)


def _eager(kind: str) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(SEED)
    model = build(kind)
    return clone_state(model), torch.get_rng_state()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["tied", "transformer"])
@pytest.mark.parametrize(("stage", "world_size"), [(1, 2), (2, 4), (3, 2), (3, 4), (3, 1)])
def test_meta_built_equals_eager_built(kind: str, stage: int, world_size: int) -> None:
    eager_initial, eager_rng = _eager(kind)
    largest = max(t.numel() * t.element_size() for t in eager_initial.values())
    for rank, result in enumerate(run_ranks(meta_worker, world_size, stage, kind, timeout_s=80)):
        assert result["initial"].keys() == eager_initial.keys()
        for name, value in eager_initial.items():
            assert torch.equal(result["initial"][name], value), f"rank {rank}: {name} differs after init"
        assert torch.equal(result["rng_after_init"], eager_rng), f"rank {rank}: generator state differs"
        for name, value in result["ddp"].items():
            got = result["trained"][name].float()
            err = ((got - value.float()).abs().max() / value.float().abs().max().clamp_min(1e-12)).item()
            assert err <= 1e-5, f"rank {rank}: {name} is {err:.1e} off DDP after {STEPS} SGD steps"
        # one replay, holding at most 3 tensors' worth at once (measured), while the model is more than that
        assert len(result["peaks"]) == 1 and 0 < result["peaks"][0] <= 3 * largest, (result["peaks"], largest)
    assert sum(v.numel() * v.element_size() for v in eager_initial.values()) > 3 * largest


def test_meta_module_without_a_recording_is_refused() -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(UnmaterializedError, match="configure_model"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))
