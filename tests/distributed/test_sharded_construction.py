"""Sharded construction: a model built on the meta device and materialized unit by unit equals the same model
built eagerly with the same seed — bit for bit after init (and the generator ends where the eager build leaves
it), and after SGD steps within 1e-5 of the eagerly built model trained under DDP — at every stage and world size.
Reseeds inside the build replay from rank 0's states on every rank (the values DDP broadcasts), and tensors the
module holds besides parameters and buffers get rank 0's eager values too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.meta_models import build
from helpers.models import clone_state, lm_loss, make_batches, rank_slice
from helpers.storage_meter import StoragePeakMeter

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.init import ModuleReplay, record_construction
from zero_strategy.core.init.materialize import InitialValues, UnmaterializedError
from zero_strategy.testing import run_ranks

STEPS, GLOBAL_BATCH, SEED, LR = 3, 8, 5, 0.3
KINDS = ("tied", "transformer", "reseeded")


def _train(model, step, rank: int, world_size: int) -> None:
    for (tokens,) in make_batches(STEPS, 1, GLOBAL_BATCH):
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        step()


def _held(model) -> dict:
    """Tensors held as plain attributes (not parameters or buffers)."""
    return {name: value.clone() for name, value in vars(model).items() if isinstance(value, torch.Tensor)}


def _meter_replays(peaks: list[int]) -> None:
    """From now on in this (forked) rank, every replay runs under a StoragePeakMeter, which appends the peak bytes
    of the storages created while it ran — the replay's own and what the FlatParams allocate to take each value."""
    replay = ModuleReplay.replay

    def metered(self: ModuleReplay, on_final: Any) -> Any:
        with StoragePeakMeter() as meter:
            stats = replay(self, on_final)
        peaks.append(meter.peak_bytes)
        return stats

    ModuleReplay.replay = metered  # type: ignore[method-assign]


def meta_worker(rank: int, world_size: int, stage: int) -> dict:
    peaks: list[int] = []
    _meter_replays(peaks)
    out = {}
    for kind in KINDS:
        before = len(peaks)
        out[kind] = _meta_built(rank, world_size, stage, kind)
        out[kind]["peaks"] = peaks[before:]
    return out


def _meta_built(rank: int, world_size: int, stage: int, kind: str) -> dict:
    torch.manual_seed(SEED + rank)  # every rank adopts rank 0's generator states, as DDP adopts its values
    if rank == 0:
        torch.manual_seed(SEED)
    with record_construction() as recording:
        model = build(kind)
    assert all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage), initial_values=InitialValues(recording))
    with engine.gathered_parameters():
        initial = clone_state(model)
    out = {"initial": initial, "rng_after_init": torch.get_rng_state(), "held": _held(model)}

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


def _eager(kind: str) -> dict:
    torch.manual_seed(SEED)
    model = build(kind)
    return {"initial": clone_state(model), "rng": torch.get_rng_state(), "held": _held(model)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("stage", "world_size"), [(1, 2), (2, 4), (3, 2), (3, 4), (3, 1)])
def test_meta_built_equals_eager_built(stage: int, world_size: int) -> None:
    results = run_ranks(meta_worker, world_size, stage, timeout_s=80)
    for kind in KINDS:
        eager = _eager(kind)
        largest = max(t.numel() * t.element_size() for t in eager["initial"].values())
        for rank, result in enumerate(r[kind] for r in results):
            what = f"{kind}, rank {rank}"
            assert result["initial"].keys() == eager["initial"].keys()
            for name, value in eager["initial"].items():
                assert torch.equal(result["initial"][name], value), f"{what}: {name} differs after init"
            assert torch.equal(result["rng_after_init"], eager["rng"]), f"{what}: generator state differs"
            assert result["held"].keys() == eager["held"].keys()
            for name, value in eager["held"].items():
                assert torch.equal(result["held"][name], value), f"{what}: held tensor {name} differs"
            trained = result["trained"]
            assert_state_close(trained, result["ddp"], rel=1e-5, what=f"{what} vs DDP after {STEPS} SGD steps")
            # one replay, holding at most 3 tensors' worth at once (measured), while the model is more than that
            assert len(result["peaks"]) == 1 and 0 < result["peaks"][0] <= 3 * largest, (what, result["peaks"])
        assert sum(v.numel() * v.element_size() for v in eager["initial"].values()) > 3 * largest, kind


def test_meta_module_without_a_recording_is_refused() -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(UnmaterializedError, match="configure_model"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))
