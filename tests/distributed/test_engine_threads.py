"""Threads the library starts end with the object that started them: three stage-3 engines made, trained and
released one after another in one process (three fits of a per-rank script) leave no thread behind on either
transport; an engine dropped without release (collected) stops its threads too."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from helpers.models import lm_loss, make_batches, make_model, rank_slice

from zero_strategy.config import ZeroConfig
from zero_strategy.core.step.engine import ZeroEngine
from zero_strategy.testing import run_ranks


def _names() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())


def _train(rank: int, world: int, collectives: str) -> ZeroEngine:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, collectives=collectives))
    for (tokens,) in make_batches(2, 1, 8):
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        engine.optimizer_step(optimizer)
        optimizer.zero_grad()
    return engine


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
