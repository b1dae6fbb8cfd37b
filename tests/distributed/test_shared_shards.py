"""Stage 3's host-wide shared parameters: chosen where they apply, equal to network gathers, safe when ranks drift
apart, read in place, and they leave nothing in /dev/shm."""

from __future__ import annotations

import os
import re
import time
import warnings

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.models import lm_loss, make_batches, make_model, rank_slice
from helpers.storage import mapped_pages

from zero_strategy.config import ZeroConfig
from zero_strategy.core.comm import engine_comms, host_segments
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import memory_report
from zero_strategy.testing import run_ranks


def _our_files(rank: int | None = None) -> list[str]:
    """Shard files in /dev/shm (of one rank: the others unlink theirs on their own time)."""
    names = [name for name in os.listdir(host_segments.SHM_DIR) if name.startswith("zero-shards-")]
    return [name for name in names if rank is None or f"-r{rank}-" in name]


def train_worker(rank, world_size, collectives, slow_rank, sabotage):
    if sabotage == "no_room":
        engine_comms.free_bytes = lambda path=host_segments.SHM_DIR: 0
    if sabotage == "full_at_allocation" and rank == 1:  # /dev/shm filled up after the space check
        def no_space(descriptor, offset, length):
            raise OSError(28, "No space left on device")
        host_segments.os.posix_fallocate = no_space
    if sabotage == "cannot_map" and rank == 1:
        def refuse(*args):
            raise FileNotFoundError("a separate /dev/shm")
        host_segments.HostSegments._map = refuse
    model = make_model(n_blocks=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, collectives=collectives))
    files_after_setup = _our_files(rank)
    if rank == slow_rank:  # this rank lags in backward: peers reach the step while it still gathers their shards
        for block in model.blocks:
            block.register_full_backward_hook(lambda *args: time.sleep(0.05))
    for (tokens,) in make_batches(3, 1, 8):
        optimizer.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        with engine.step_window(optimizer):
            if rank == slow_rank:  # and late to write: peers must not gather its shards before they are new
                time.sleep(0.05)
            optimizer.step()
    shared = engine.comms.host_shared
    engine.release()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    warned = [str(w.message) for w in caught if "shared-memory gathers unavailable" in str(w.message)]
    return {"weights": weights, "shared": shared, "files_after_setup": files_after_setup, "warned": warned}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_shared_memory_gathers_match_network_gathers_with_lagging_rank(world_size):
    """Ranks that drift apart still read each other's shards only when complete: the steps are bracketed by
    barriers, so a fast rank neither gathers a slow rank's shard before its step wrote it nor writes its own while
    the slow rank may still be gathering it."""
    shared = run_ranks(train_worker, world_size, "auto", 1, None, timeout_s=100)
    network = run_ranks(train_worker, world_size, "point_to_point", None, None, timeout_s=100)
    for rank in range(world_size):
        assert shared[rank]["shared"] and not network[rank]["shared"]
        assert shared[rank]["files_after_setup"] == []  # unlinked once every rank mapped them
        torch.testing.assert_close(shared[rank]["weights"], network[rank]["weights"], rtol=0, atol=0)
    assert _our_files() == []


@pytest.mark.timeout(60)
def test_no_room_in_dev_shm_falls_back_to_network_gathers():
    """...and says so once, with the room needed and the room there (the memory per rank changes: each rank then
    holds the units it gathers)."""
    for result in run_ranks(train_worker, 2, "auto", None, "no_room", timeout_s=50):
        assert not result["shared"]
        assert len(result["warned"]) == 1, result["warned"]
        assert re.search(r"[\d.]+ [KMG]i?B free in /dev/shm \(0 B free here\).*point-to-point", result["warned"][0])


@pytest.mark.timeout(60)
def test_explicit_shared_memory_without_room_is_an_error_that_names_the_fix():
    with pytest.raises(Exception, match=r"shared_memory.*/dev/shm.*point_to_point"):
        run_ranks(train_worker, 2, "shared_memory", None, "no_room", timeout_s=50)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sabotage", ["cannot_map", "full_at_allocation"])
def test_a_rank_without_shared_shards_makes_every_rank_fall_back(sabotage):
    """One rank failing (no shared /dev/shm, or no room left when allocating) must not leave its peers waiting in a
    collective: every rank agrees and uses point-to-point gathers, with the same result."""
    results = run_ranks(train_worker, 2, "auto", None, sabotage, timeout_s=50)
    assert [r["shared"] for r in results] == [False, False]
    assert all(len(r["warned"]) == 1 and "rank 1 could not" in r["warned"][0] for r in results), results
    reference = run_ranks(train_worker, 2, "point_to_point", None, None, timeout_s=50)
    for got, expected in zip(results, reference, strict=True):
        torch.testing.assert_close(got["weights"], expected["weights"], rtol=0, atol=0)
    assert _our_files() == []


def in_place_worker(rank, world_size):
    model = make_model(n_blocks=3, width=128)  # a block's slice spans many pages
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, prefetch=False, collectives="auto"))  # read in place
    by_unit = {unit.name: unit.flat_params[0] for unit in engine.units}
    blocks = [by_unit[f"blocks.{i}"] for i in range(3)]

    def peers(flat):  # every rank's slice but ours
        node = flat.storage.full
        size = node.tensor.element_size()
        return node.tensor[node.own_bytes[1] // size :] if rank == 0 else node.tensor[: node.own_bytes[0] // size]

    # peer pages mapped, per block, in the middle of each block's forward and at the end of each block's backward
    held = []
    for i, block in enumerate(model.blocks):
        block.fc.register_forward_hook(lambda *args, i=i: held.append(
            ("forward", i, [mapped_pages(peers(flat))[0] for flat in blocks])))
        block.register_full_backward_hook(lambda *args, i=i: held.append(
            ("backward", i, [mapped_pages(peers(flat))[0] for flat in blocks])))
    for (tokens,) in make_batches(2, 1, 8):
        optimizer.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        engine.optimizer_step(optimizer)
    flat = blocks[1]
    node = flat.storage.full
    assert node.readable_in_place
    size = node.tensor.element_size()
    own = node.tensor[node.own_bytes[0] // size : node.own_bytes[1] // size]
    # the module's parameters are views of the node's buffer: nothing is gathered into a private copy
    same_storage = all(p.untyped_storage().data_ptr() == node.tensor.untyped_storage().data_ptr() for p in flat.params)
    # the master slice the optimizer stepped is this rank's slice of it
    master_is_slice = flat.shard.data_ptr() == own.data_ptr()
    released = (mapped_pages(own), mapped_pages(peers(flat)))
    with engine.gathered_parameters():
        values = {name: p.detach().clone() for name, p in zip(flat.names, flat.params, strict=True)}  # in place
        in_use = mapped_pages(peers(flat))
    report = memory_report(engine)
    engine.release()
    return {"same_storage": same_storage, "master_is_slice": master_is_slice, "released": released,
            "in_use": in_use, "values": values, "report": report, "held": held}


def _single_process_training() -> dict[str, torch.Tensor]:
    """The reference for in_place_worker: the same model, AdamW and data, on the whole batch in one process (each
    rank's loss is the mean over an equal slice, so ZeRO's averaged gradient is the whole batch's)."""
    model = make_model(n_blocks=3, width=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for (tokens,) in make_batches(2, 1, 8):
        optimizer.zero_grad()
        lm_loss(model, tokens).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.named_parameters()}


@pytest.mark.timeout(60)
def test_parameters_are_read_in_place_and_peers_pages_leave_after_use():
    """Stage 3 on one host: every rank's module views one buffer per unit (the master slice in it), so the ranks
    see the same values without gathering; a released unit keeps only the rank's own pages resident."""
    results = run_ranks(in_place_worker, 2, timeout_s=50)
    for rank, result in enumerate(results):
        assert result["same_storage"] and result["master_is_slice"], f"rank {rank}"
        (own_mapped, own_pages), (peer_mapped, peer_pages) = result["released"]
        assert own_mapped == own_pages, f"rank {rank}: its own slice stays resident"
        # a page shared with the neighbour's slice stays mapped; every other peer page left
        assert peer_mapped <= 1 and peer_pages > 2, f"rank {rank}: {peer_mapped}/{peer_pages} peer pages mapped"
        assert result["in_use"][0] == result["in_use"][1], f"rank {rank}: peers' pages read in place"
        for phase, i, pages in result["held"]:  # (a page shared with our own slice may stay: <= 1)
            if phase == "forward":  # computing from the peers' pages in place; the blocks before it let theirs go
                assert pages[i] > 1 and all(n <= 1 for n in pages[:i]), f"rank {rank}, {phase} {i}: {pages}"
            else:  # the block and those after it finished their backward and let their peers' pages go
                assert all(n <= 1 for n in pages[i:]), f"rank {rank}, {phase} {i}: {pages}"
    # what every rank read in place is the trained model: the values a single process computes
    reference = _single_process_training()
    for rank, result in enumerate(results):
        assert sorted(result["values"]) == sorted(n for n in reference if n.startswith("blocks.1.")), rank
        expected = {name: reference[name] for name in result["values"]}
        assert_state_close(result["values"], expected, rel=1e-5, what=f"rank {rank} vs the single-process run")
    assert results[0]["report"] == results[1]["report"]


def in_place_change_worker(rank, world_size, change):
    model = make_model(n_blocks=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, collectives="auto"))  # shared memory
    halved = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, micro_batches in enumerate(make_batches(3, 2, 8)):
            optimizer.zero_grad()
            for tokens in micro_batches:  # accumulation: two uses of every unit per step
                lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
            engine.optimizer_step(optimizer)
            if change and step == 0:
                weight = model.blocks[1].fc.weight
                before = weight.detach().clone()
                with engine.gathered_parameters(), torch.no_grad():
                    weight.mul_(0.5)  # every rank halves its own copy; the release takes it in once
                halved = bool(torch.equal(weight.detach(), before * 0.5))
    engine.release()
    return {"halved": halved,
            "messages": [str(w.message) for w in caught if "changed in place outside" in str(w.message)]}


@pytest.mark.timeout(60)
def test_an_in_place_change_inside_gathered_parameters_lands_once_and_training_alone_is_silent():
    """A change every rank makes inside gathered_parameters() is made on each rank's own copy and taken into the
    masters once at the release (not once per rank on the host-wide buffer); the engine's own writes (optimizer
    steps, accumulation) are never taken for a user's change."""
    changed = run_ranks(in_place_change_worker, 2, True, timeout_s=50)
    for rank, result in enumerate(changed):
        assert result == {"halved": True, "messages": []}, f"rank {rank}: {result}"
    assert run_ranks(in_place_change_worker, 2, False, timeout_s=50) == [{"halved": None, "messages": []}] * 2
