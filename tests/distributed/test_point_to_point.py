"""The point-to-point all-gather and reduce-scatter (gloo's default) against torch's own collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.models import lm_loss, make_batches, make_model, rank_slice

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.step.engine import ZeroEngine
from zero_strategy.core.transport import point_to_point
from zero_strategy.core.transport.collectives import CommunicationLog, prefers_point_to_point, start_reduce_scatter_mean
from zero_strategy.testing import run_ranks


def exchange_worker(rank: int, world_size: int, use_subgroup: bool) -> dict[str, bool]:
    group = None
    if use_subgroup:  # the odd ranks only: group ranks differ from global ranks
        members = [r for r in range(world_size) if r % 2 == 1]
        group = dist.new_group(members)
        if rank not in members:
            return {}
    world = dist.get_world_size(group)
    generator = torch.Generator().manual_seed(100 + rank)
    flat = torch.randn(world * 1001, generator=generator)
    shard = torch.randn(1001, generator=generator)

    reference_gather = torch.empty(world * 1001)
    dist.all_gather_into_tensor(reference_gather, shard, group=group)
    reference_reduce = torch.empty(1001)
    dist.reduce_scatter_tensor(reference_reduce, flat.clone(), group=group)

    # Two exchanges in flight at once (a prefetch gather while a reduction runs), waited in reverse order.
    gathered = torch.empty(world * 1001)
    reduced = torch.empty(1001)
    gather = point_to_point.all_gather(gathered, shard, group)
    reduce = point_to_point.reduce_scatter_sum(reduced, flat, group)
    reduce.wait()
    gather.wait()
    mean = start_reduce_scatter_mean(flat, group, CommunicationLog(), point_to_point=True).wait()
    return {
        "gather_equal": torch.equal(gathered, reference_gather),
        "reduce_close": torch.allclose(reduced, reference_reduce, rtol=1e-6, atol=1e-6),
        "mean_close": torch.allclose(mean, reference_reduce / world, rtol=1e-6, atol=1e-6),
        "prefers_p2p_on_gloo": prefers_point_to_point(group),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world_size", "use_subgroup"), [(2, False), (4, False), (4, True)])
def test_exchanges_match_torch_collectives(world_size: int, use_subgroup: bool) -> None:
    results = [r for r in run_ranks(exchange_worker, world_size, use_subgroup, timeout_s=50) if r]
    assert len(results) == (2 if use_subgroup else world_size)
    for result in results:
        assert result == {"gather_equal": True, "reduce_close": True, "mean_close": True, "prefers_p2p_on_gloo": True}


ORDER_SENSITIVE = [1.0, 2.0**24, 1.0, -(2.0**24)]  # rank r contributes ORDER_SENSITIVE[r] to every element


def reduction_order_worker(rank: int, world_size: int) -> list[float]:
    out = torch.empty(3)
    point_to_point.reduce_scatter_sum(out, torch.full((world_size * 3,), ORDER_SENSITIVE[rank]), None).wait()
    return out.tolist()


@pytest.mark.timeout(60)
def test_reduction_sums_in_rank_order_on_every_rank() -> None:
    """In float32, 1 + 2^24 rounds back to 2^24: rank order gives 0, a rank adding its own value first would
    give 2. Every rank must produce the rank-order result, so the same slice never depends on who computes it."""
    rank_order = torch.tensor(0.0)
    for value in ORDER_SENSITIVE:
        rank_order = rank_order + torch.tensor(value)
    assert rank_order.item() == 0.0
    for result in run_ranks(reduction_order_worker, 4, timeout_s=50):
        assert result == [0.0, 0.0, 0.0]


def training_worker(rank: int, world_size: int, stage: int, collectives: str) -> list[float]:
    model = make_model(vocab=13, width=31, n_blocks=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives=collectives))
    for (tokens,) in make_batches(3, 1, 8, vocab=13):
        optimizer.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        engine.optimizer_step(optimizer)
    engine.release()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_native_and_point_to_point_train_alike(stage: int) -> None:
    p2p = torch.tensor(run_ranks(training_worker, 2, stage, "point_to_point", timeout_s=80)[0])
    native = torch.tensor(run_ranks(training_worker, 2, stage, "native", timeout_s=80)[0])
    torch.testing.assert_close(p2p, native, rtol=1e-5, atol=1e-6)


def test_collectives_option_is_validated() -> None:
    with pytest.raises(ZeroConfigError, match="collectives='ring'"):
        ZeroConfig(collectives="ring")
