"""The in-process Comm (the transport of the logic tests) against the same exchanges computed by hand: the unit
tests that run engines on it compare one of its results with another (held against reduced gradients), so without
this a wrong sum here would pass them all alike."""

from __future__ import annotations

import threading

import pytest
import torch

from zero_strategy.core.comm.comm import ReduceOp
from zero_strategy.core.comm.in_process import InProcessComm, InProcessWorld
from zero_strategy.core.comm.log import CommunicationLog

CHUNK = 5


def _inputs(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's flat buffer to reduce-scatter, its shard to gather): distinct values on every rank."""
    values = torch.Generator().manual_seed(10 + rank)
    return torch.randn(world * CHUNK, generator=values), torch.randn(CHUNK, generator=values)


def _exchange(world: InProcessWorld, rank: int, results: list[dict[str, torch.Tensor]]) -> None:
    comm = InProcessComm(world.group(rank).describe(), CommunicationLog())
    flat, shard = _inputs(rank, world.size)
    gathered = torch.empty(world.size * CHUNK)
    gather = comm.all_gather(gathered, shard, "unit")
    mean_into = torch.empty(CHUNK)
    reduced = comm.reduce_scatter(flat, "unit", out=mean_into).wait()
    gather.wait()
    total = comm.all_reduce(flat.clone(), ReduceOp.SUM, "sum").wait()
    average = comm.all_reduce(flat.clone(), ReduceOp.MEAN, "mean").wait()
    largest = comm.all_reduce(flat.clone(), ReduceOp.MAX, "max").wait()
    sent = torch.full((3,), float(rank)) if rank == 1 else torch.zeros(3)
    broadcast = comm.broadcast(sent, 1, "from rank 1").wait()
    objects = comm.all_gather_object({"rank": rank}, "objects")
    results[rank] = {"gathered": gathered, "reduced": reduced.clone(), "into_out": mean_into.data_ptr()
                     == reduced.data_ptr(), "sum": total, "mean": average, "max": largest,
                     "broadcast": broadcast.clone(), "objects": objects}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exchanges_equal_hand_computed_values(world_size: int) -> None:
    world = InProcessWorld(world_size, timeout_s=20)
    results: list[dict] = [{} for _ in range(world_size)]
    threads = [threading.Thread(target=_exchange, args=(world, rank, results)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(25)
    assert world.failure is None and all(results), f"a simulated rank failed: {world.failure}"

    flats = torch.stack([_inputs(rank, world_size)[0] for rank in range(world_size)])
    shards = torch.cat([_inputs(rank, world_size)[1] for rank in range(world_size)])
    total = flats[0].clone()
    for flat in flats[1:]:  # rank order, as every transport sums
        total += flat
    for rank, got in enumerate(results):
        assert torch.equal(got["gathered"], shards), rank
        expected_mean = total[rank * CHUNK : (rank + 1) * CHUNK] / world_size
        torch.testing.assert_close(got["reduced"], expected_mean, rtol=0, atol=1e-6)
        assert got["into_out"], "reduce_scatter(out=...) must return the tensor it was given"
        torch.testing.assert_close(got["sum"], total, rtol=0, atol=1e-6)
        torch.testing.assert_close(got["mean"], total / world_size, rtol=0, atol=1e-6)
        assert torch.equal(got["max"], flats.amax(0)), rank
        assert torch.equal(got["broadcast"], torch.full((3,), 1.0)), rank
        assert got["objects"] == [{"rank": r} for r in range(world_size)], rank
