"""Shared-memory reductions (and stages 1/2's shared-memory gathers): bit-identical to the point-to-point path at
every stage, with accumulation, low-precision reduction and FlatParams too large for the arenas; the same bytes in
the log; a missing or dead peer is an error that names what was waited for, not a hang."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from helpers.models import lm_loss, make_batches, make_model, rank_slice

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.comm import engine_comms, shm_exchange
from zero_strategy.core.comm.engine_comms import network_comm
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.comm.shared_memory import SharedMemoryComm
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.testing import run_ranks

pytestmark = pytest.mark.skipif(not shm_exchange.spin_sync_is_sound(), reason="x86-64 only (see the Note)")


def _shared(engine: ZeroEngine) -> SharedMemoryComm | None:
    shard = engine.comms.shard
    return shard if isinstance(shard, SharedMemoryComm) else None


def train_worker(rank, world_size, stage, collectives, accum, bf16, arena_cap):
    if arena_cap is not None:  # FlatParams above the cap reduce point-to-point, the others through shared memory
        engine_comms.ARENA_CAP_BYTES = arena_cap
    model = make_model(n_blocks=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives=collectives), policy=policy)
    exchange = _shared(engine)
    through_shared = [isinstance(flat.comm, SharedMemoryComm) for flat in engine.flat_params]
    if rank == 1:  # a lagging rank: peers reach every exchange before it has written its part
        for block in model.blocks:
            block.register_full_backward_hook(lambda *args: time.sleep(0.02))
    bytes_per_step = []
    for micro_batches in make_batches(3, accum, 8):
        engine.comm_log.reset()
        optimizer.zero_grad()
        for tokens in micro_batches:
            lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        with engine.step_window(optimizer):
            if rank == 1:  # and late to step: peers must not gather its slice before it is new
                time.sleep(0.02)
            optimizer.step()
        bytes_per_step.append(dict(engine.comm_log.bytes_by_kind))
    posted = exchange.posted if exchange is not None else 0
    engine.release()
    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return {"weights": weights, "through_shared": through_shared, "bytes": bytes_per_step, "posted": posted}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("stage", "world_size", "accum", "bf16"),
    [(1, 2, 1, False), (2, 2, 2, False), (3, 2, 1, True), (1, 4, 2, True), (2, 4, 1, True), (3, 4, 2, False)],
)
def test_shared_memory_exchanges_equal_point_to_point_bit_for_bit(stage, world_size, accum, bf16):
    shared = run_ranks(train_worker, world_size, stage, "auto", accum, bf16, None, timeout_s=200)
    network = run_ranks(train_worker, world_size, stage, "point_to_point", accum, bf16, None, timeout_s=200)
    flats, steps = len(shared[0]["through_shared"]), 3
    # what went through shared memory, per step: every FlatParam's reduction (stage 1 once per step, stages 2/3 per
    # micro-batch), at stages 1/2 its gather of the updated slices, the agreement on used parameters and, at stage
    # 3, the two barriers around the step that guard the host-wide parameters (plus, once, the barrier after
    # construction: every rank wrote its slices of them before any reads)
    reductions = 1 if stage == 1 else accum
    gathers = 0 if stage == 3 else 1
    per_step = flats * (reductions + gathers) + 1 + (2 if stage == 3 else 0)
    for got, expected in zip(shared, network, strict=True):
        assert all(got["through_shared"]) and not any(expected["through_shared"])
        assert got["posted"] == steps * per_step + (1 if stage == 3 else 0) and expected["posted"] == 0
        torch.testing.assert_close(got["weights"], expected["weights"], rtol=0, atol=0)
        # the log counts the same exchanges, whatever carried them; stage 3 on one host reads its parameters in
        # place (see [Note: shared-memory gathers]): no gathers at all, where the network path gathers every unit
        kinds = ("reduce_scatter",) if stage == 3 else ("reduce_scatter", "all_gather")
        for kind in kinds:
            assert [step[kind] for step in got["bytes"]] == [step[kind] for step in expected["bytes"]]
        if stage == 3:
            assert all(step.get("all_gather", 0) == 0 for step in got["bytes"])
            assert all(step["all_gather"] > 0 for step in expected["bytes"])
        else:  # at stage 3 the network gathers add the divergence watch's per-step checksum
            assert [step["all_reduce"] for step in got["bytes"]] == [step["all_reduce"] for step in expected["bytes"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 3])
def test_flat_params_larger_than_the_arenas_reduce_point_to_point_in_the_same_run(stage):
    """A cap between the small FlatParams and the largest one: both paths in one step, in the same order on every
    rank, with the point-to-point path's result."""
    probe = make_model(n_blocks=3)
    sizes = sorted({p.numel() * 4 for p in probe.parameters()})
    cap = sizes[-1] - 1  # the largest parameter's FlatParam does not fit; the blocks' do
    mixed = run_ranks(train_worker, 2, stage, "auto", 2, False, cap, timeout_s=100)
    network = run_ranks(train_worker, 2, stage, "point_to_point", 2, False, None, timeout_s=100)
    for got, expected in zip(mixed, network, strict=True):
        assert any(got["through_shared"]) and not all(got["through_shared"]), got["through_shared"]
        torch.testing.assert_close(got["weights"], expected["weights"], rtol=0, atol=0)


def absent_peer_worker(rank, world_size, how, misses, reported: Path):
    """Rank 1 misses an exchange (``misses``: the first reduction of a stage-2 backward, or the stage-3 optimizer
    step after a full backward) and sleeps or exits; rank 0 reports what its wait ended with. A sleeping rank 1
    stays alive until rank 0 has its outcome (the file ``reported`` appears; 10 s at most), so what ended rank 0's
    wait cannot have been its exit."""
    stage = 2 if misses == "reduction" else 3
    model = make_model(n_blocks=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, process_group_timeout_s=1.0, collectives="auto"))
    assert _shared(engine) is not None and (stage == 2 or engine.comms.host_shared)
    (tokens,) = make_batches(1, 1, 4)[0]
    if misses == "step":
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
    if rank == 1:  # still running, or its process ends (a crash looks the same)
        if how == "sleeps":
            give_up = time.monotonic() + 10.0
            while not reported.exists() and time.monotonic() < give_up:
                time.sleep(0.02)
            assert reported.exists(), "rank 0 did not report within 10 s"
        return None
    started = time.monotonic()
    try:
        if misses == "reduction":
            lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        else:
            with engine.step_window(optimizer):
                optimizer.step()
    except shm_exchange.SharedReductionError as error:
        return {"message": str(error), "seconds": time.monotonic() - started}
    finally:
        reported.touch()
    return {"message": "", "seconds": time.monotonic() - started}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "expected"), [("sleeps", r"rank\(s\) \[1\] did not reach.*unit 'blocks\.\d'.*"
                                                "process_group_timeout_s=1"), ("exits", r"rank\(s\) \[1\].*exited")])
def test_a_peer_that_never_arrives_is_an_error_naming_the_unit(how, expected, tmp_path):
    outcome = run_ranks(absent_peer_worker, 2, how, "reduction", tmp_path / "reported", timeout_s=40,
                        pg_timeout_s=20)[0]
    assert outcome["message"], "the waiting rank must raise instead of hanging"
    assert re.search(expected, outcome["message"]), outcome["message"]
    assert outcome["seconds"] < 4.5  # the sleeping rank is still alive then: the timeout, not its exit, stopped us


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "expected"), [("sleeps", r"rank\(s\) \[1\] did not reach.*used-parameter agreement.*"
                                                "process_group_timeout_s=1"), ("exits", r"rank\(s\) \[1\].*exited")])
def test_a_peer_that_skips_the_step_is_an_error_naming_the_agreement(how, expected, tmp_path):
    """The per-step collectives that go through the shared counters (the agreement on used parameters, stage 3's
    barriers around the step) fail like the reductions: within the timeout, saying what was waited for."""
    outcome = run_ranks(absent_peer_worker, 2, how, "step", tmp_path / "reported", timeout_s=40, pg_timeout_s=20)[0]
    assert outcome["message"], "the waiting rank must raise instead of hanging"
    assert re.search(expected, outcome["message"]), outcome["message"]
    assert outcome["seconds"] < 4.5


def slack_worker(rank, world_size, late_s):
    """Rank 0 asks for ``ARENAS + 1`` arenas in a row and posts into each; rank 1 arrives ``late_s`` later. Right
    after each arena is handed out, rank 0 notes how far the peer had got (its posted and done counters)."""
    log = CommunicationLog()
    network = network_comm(None, "point_to_point", log)
    exchange = shm_exchange.SharedExchange(network, 4096, 20.0, log)
    assert exchange.connect()
    comm = SharedMemoryComm(exchange, network)
    if rank == 1:  # a peer that is late to every exchange
        time.sleep(late_s)
    peer_progress, operations = [], []
    for index in range(shm_exchange.ARENAS + 1):
        buffer = comm.reduce_input(8, torch.float32, torch.device("cpu"))
        peer_progress.append((exchange._posted[1 - rank].value, exchange._done[1 - rank].value))
        buffer.fill_(10 * index + rank)
        operations.append(comm.reduce_scatter(buffer, f"unit {index}"))
    return {"peer_progress": peer_progress, "results": [operation.wait().tolist() for operation in operations]}


@pytest.mark.timeout(60)
def test_a_rank_posts_up_to_the_arena_count_ahead_of_a_late_peer_and_then_waits():
    """The protocol's slack: ``ARENAS`` arenas are handed out while the peer has posted nothing (no wait for it),
    the next only once the peer has read the first exchange (that arena is reused), and every result is the average
    of both ranks' values."""
    fast, _ = run_ranks(slack_worker, 2, 1.5, timeout_s=40)
    *ahead, reused = fast["peer_progress"]
    assert all(progress == (0, 0) for progress in ahead), fast["peer_progress"]
    assert reused[1] >= 1, fast["peer_progress"]  # the arena of exchange 1 came back only after the peer read it
    for index, result in enumerate(fast["results"]):
        assert result == [10 * index + 0.5] * 4  # rank 0's chunk: (own + peer's) / 2


def test_explicit_shared_memory_is_accepted_at_stages_1_and_2_and_refused_at_stage_3_with_offload():
    ZeroConfig(stage=1, collectives="shared_memory")
    ZeroConfig(stage=2, collectives="shared_memory", offload_optimizer="cpu")
    with pytest.raises(ZeroConfigError, match=r"stage 3 with offload.*point_to_point"):
        ZeroConfig(stage=3, collectives="shared_memory", offload_optimizer="cpu")
