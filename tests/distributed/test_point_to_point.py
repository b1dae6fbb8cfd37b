"""The point-to-point Comm (gloo's default) against torch's own collectives, and the bytes it counts per peer
against the bytes each exchange must send, computed by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.models import lm_loss, make_batches, make_model, rank_slice

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.comm.comm import ReduceOp
from zero_strategy.core.comm.engine_comms import network_comm
from zero_strategy.core.comm.group import Group
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.comm.point_to_point import PointToPointComm
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks


def exchange_worker(rank: int, world_size: int, use_subgroup: bool) -> dict[str, object]:
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

    log = CommunicationLog()
    comm = network_comm(group, "auto", log)
    # Two exchanges in flight at once (a prefetch gather while a reduction runs), waited in reverse order.
    gathered = torch.empty(world * 1001)
    gather = comm.all_gather(gathered, shard, "unit")
    reduce = comm.reduce_scatter(flat, "unit")
    mean = reduce.wait()
    gather.wait()
    maximum = comm.all_reduce(torch.tensor([float(rank), -float(rank)]), ReduceOp.MAX, "flags").wait()
    total = comm.all_reduce(torch.full((3,), float(rank + 1)), ReduceOp.SUM, "norm").wait()
    return {
        "gather_equal": torch.equal(gathered, reference_gather),
        "mean_close": torch.allclose(mean, reference_reduce / world, rtol=1e-6, atol=1e-6),
        "point_to_point_on_gloo": isinstance(comm, PointToPointComm),
        "max": maximum.tolist(),
        "sum": total.tolist(),
        "moved": dict(log.bytes_by_peer),
        "members": list(Group.of(group).members),
        "me": dist.get_rank(),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world_size", "use_subgroup"), [(2, False), (4, False), (4, True)])
def test_exchanges_match_torch_collectives(world_size: int, use_subgroup: bool) -> None:
    results = [r for r in run_ranks(exchange_worker, world_size, use_subgroup, timeout_s=50) if r]
    group_size = 2 if use_subgroup else world_size
    assert len(results) == group_size
    for result in results:
        assert result["gather_equal"] and result["mean_close"] and result["point_to_point_on_gloo"]
        members = result["members"]  # each rank contributed its global rank (and its negation), and rank + 1
        assert result["max"] == [max(members), -min(members)]
        assert result["sum"] == [sum(member + 1 for member in members)] * 3
        # Bytes handed to isend, per peer, computed by hand: the gather sends the 1001-float shard to every peer and
        # the reduce-scatter each peer's 1001-float chunk; the max sends the 2 floats to every peer; the sum of 3
        # floats pads to ceil(3/N)·N, then sends each peer its chunk and then this rank's chunk (ceil(3/N) each way).
        chunk = -(-3 // group_size)
        expected = 4 * (1001 + 1001 + 2 + 2 * chunk)
        peers = [member for member in result["members"] if member != result["me"]]
        assert result["moved"] == dict.fromkeys(peers, expected)


ORDER_SENSITIVE = [1.0, 2.0**24, 1.0, -(2.0**24)]  # rank r contributes ORDER_SENSITIVE[r] to every element


def reduction_order_worker(rank: int, world_size: int) -> list[float]:
    comm = network_comm(None, "point_to_point", CommunicationLog())
    summed = comm.all_reduce(torch.full((world_size * 3,), ORDER_SENSITIVE[rank]), ReduceOp.SUM, "order").wait()
    return summed[:3].tolist()


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
