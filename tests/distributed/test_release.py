"""Releasing the engine of a model built sharded at stage 3 leaves its parameters sharded (no gather: the whole
model is never resident), and a later engine over the same module takes the weights back from the released slices
— bit for bit, each rank reading its own (see [Note: releasing a model built sharded] in core/engine/release.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.meta_models import build
from helpers.models import clone_state, lm_loss, make_batches, rank_slice

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.release import ReleasedShards
from zero_strategy.core.init import record_construction
from zero_strategy.core.init.materialize import InitialValues, Pretrained
from zero_strategy.testing import run_ranks

SEED, LR = 5, 0.3


def _trained_meta_engine(rank: int, world_size: int, config: ZeroConfig) -> tuple[torch.nn.Module, ZeroEngine]:
    torch.manual_seed(SEED)
    with record_construction() as recording:
        model = build("tied")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = ZeroEngine(model, [optimizer], config, initial_values=InitialValues(recording))
    for (tokens,) in make_batches(2, 1, 8):
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        engine.optimizer_step(optimizer)
        optimizer.zero_grad()
    return model, engine


def release_worker(rank: int, world_size: int) -> dict:
    model, engine = _trained_meta_engine(rank, world_size, ZeroConfig(stage=3))
    with engine.gathered_parameters():
        trained = clone_state(model)
    tied = model.head.weight is model.emb.weight
    sent_before = sum(engine.comm_log.bytes_by_kind.values())
    full = engine.release()
    out = {
        "full": full,
        "gathered_bytes": sum(engine.comm_log.bytes_by_kind.values()) - sent_before,
        "all_meta": all(p.is_meta for p in model.parameters()),
        "shapes_kept": {k: tuple(v.shape) for k, v in model.state_dict().items()}
        == {k: tuple(v.shape) for k, v in trained.items()},
        "still_tied": tied and model.head.weight is model.emb.weight,
    }
    # a later engine over the same module (Lightning: test() after fit()) reads its slices back
    plan = ReleasedShards(engine.flat_params).plan_for(model)
    values = InitialValues(pretrained=Pretrained(plan), device=torch.device("cpu"))
    again = ZeroEngine(model, [], ZeroConfig(stage=3), initial_values=values)
    out["taken_back_full"] = again.release(full=True)
    out["taken_back"] = clone_state(model)
    out["trained"] = trained
    # asked for explicitly, a model built sharded is gathered as before
    model2, engine2 = _trained_meta_engine(rank, world_size, ZeroConfig(stage=3, full_params_after_fit=True))
    out["forced_full"] = engine2.release() and not any(p.is_meta for p in model2.parameters())
    return out


def eager_release_worker(rank: int, world_size: int) -> bool:
    torch.manual_seed(SEED)
    model = build("tied")
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=LR)], ZeroConfig(stage=3))
    return engine.release() and not any(p.is_meta for p in model.parameters())


@pytest.mark.timeout(90)
def test_a_model_built_sharded_stays_sharded_and_is_taken_back_exactly() -> None:
    for rank, out in enumerate(run_ranks(release_worker, 2, timeout_s=70)):
        assert out["full"] is False and out["all_meta"] and out["shapes_kept"] and out["still_tied"], rank
        assert out["gathered_bytes"] == 0, f"rank {rank}: the sharded release communicated {out['gathered_bytes']} B"
        assert out["taken_back_full"] is True
        for name, value in out["trained"].items():
            assert torch.equal(out["taken_back"][name], value), f"rank {rank}: {name} changed on the way back"
        assert out["forced_full"], "full_params_after_fit=True must gather a model built sharded"
    # a model built eagerly on every rank fitted whole: it is still gathered by default
    assert all(run_ranks(eager_release_worker, 2, timeout_s=60))
