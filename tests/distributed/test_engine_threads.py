"""Threads the library starts end with the object that started them: three stage-3 engines made, trained and
released one after another in one process (three fits of a per-rank script) leave no thread behind on either
transport; an engine dropped without release (collected) stops its threads too, also while the user keeps the
model and the optimizer it hooked (see [Note: hooks hold the engine weakly] in core/runtime/owned_hook.py)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from helpers.models import lm_loss, make_batches, make_model, rank_slice

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks


def _names() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())


def _train(rank: int, world: int, collectives: str) -> ZeroEngine:
    return _train_kept(rank, world, collectives)[0]


def _train_kept(rank: int, world: int, collectives: str) -> tuple[ZeroEngine, torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, collectives=collectives))
    for (tokens,) in make_batches(2, 1, 8):
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        engine.optimizer_step(optimizer)
        optimizer.zero_grad()
    return engine, model, optimizer


def threads_worker(rank: int, world: int, collectives: str) -> dict:
    before = _names()
    during = []
    for _ in range(3):
        engine = _train(rank, world, collectives)
        during.append(_names())
        engine.release()
    after_release = _names()
    engine = _train(rank, world, collectives)
    del engine
    gc.collect()
    return {"before": before, "during": during, "after_release": after_release, "after_collect": _names()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collectives", ["auto", "point_to_point"])
def test_released_or_collected_engines_leave_no_thread(collectives: str) -> None:
    for r in run_ranks(threads_worker, 2, collectives, timeout_s=100):
        if collectives == "point_to_point":  # the divergence watch runs while the engine does (the check can fail)
            assert all("zero-gather-watch" in names for names in r["during"]), r["during"]
        assert r["after_release"] == r["before"], (r["before"], r["after_release"])
        assert r["after_collect"] == r["before"], (r["before"], r["after_collect"])


def keep_model_worker(rank: int, world: int, collectives: str) -> dict:
    before = _names()
    engine, model, optimizer = _train_kept(rank, world, collectives)
    during = _names()
    host_shared = engine.comms.host_shared  # stage 3 reads the parameters in shared memory
    engine_ref, comms_closer = weakref.ref(engine), engine._closer
    del engine  # the model (with the engine's hooks on it) and the optimizer (its zero_grad callback) stay
    gc.collect()
    return {"before": before, "during": during, "after_collect": _names(), "host_shared": host_shared,
            "engine_collected": engine_ref() is None, "comms_closed": not comms_closer.alive,
            "kept": (len(list(model.parameters())), len(optimizer.param_groups))}


# "auto" is the shared-memory transport (one host's CPU ranks): it starts no thread, so there the test holds the
# engine's collection (weakref) and its comms' close; "point_to_point" starts the divergence watch, which must be
# running before the drop and gone after it.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("collectives", "watch_thread"),
    [pytest.param("auto", False, id="shared_memory-no_thread-engine_collected"),
     pytest.param("point_to_point", True, id="point_to_point-watch_thread_stops")],
)
def test_engine_dropped_while_the_model_is_kept_is_collected_with_its_threads(
    collectives: str, watch_thread: bool
) -> None:
    for r in run_ranks(keep_model_worker, 2, collectives, timeout_s=100):
        assert r["host_shared"] == (collectives == "auto"), r  # the transport the parametrization names
        assert r["kept"][0] > 0 and r["kept"][1] == 1, r["kept"]
        if watch_thread:  # something was started: the check below can fail
            assert "zero-gather-watch" in r["during"] and "zero-gather-watch" not in r["before"], r
        else:
            assert r["during"] == r["before"], (r["before"], r["during"])
        assert r["engine_collected"], "the model's or the optimizer's hooks keep the dropped engine alive"
        assert r["comms_closed"], "the engine was collected but its comms were not closed"
        assert r["after_collect"] == r["before"], (r["before"], r["after_collect"])
