"""Numerical parity of ZeRO stages 1/2/3 with a single process doing the same math on the whole global batch.

Each rank takes its equal slice of the global batch and uses the mean loss of its slice; the reduced gradient is
the mean over ranks, i.e. the gradient of the global-batch mean — what the single-process reference computes.
The reference never touches zero_strategy.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.compare import ZERO_FLOOR, assert_values_close
from helpers.models import assert_state_close, clone_state, lm_loss, make_batches, make_model, rank_slice

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks

STEPS = 4
GLOBAL_BATCH = 8
STAGES = [1, 2, 3]
WORLDS = [1, 2, 4]
ACCUMS = [1, 3]


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "plain_sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


@functools.cache
def reference_run(opt_name: str, accum: int, steps: int, clip: tuple[str, float, float] | None = None):
    """Single process: per step, ``accum`` micro-batches of the whole global batch, loss / accum.

    Returns the state after each step, the per-micro-batch losses and the pre-clipping gradient norms.
    """
    model = make_model()
    optimizer = make_optimizer(opt_name, model.parameters())
    states, losses, norms = [], [], []
    for micro in make_batches(steps, accum, GLOBAL_BATCH):
        optimizer.zero_grad()
        for tokens in micro:
            loss = lm_loss(model, tokens) / accum
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            kind, value, norm_type = clip
            if kind == "norm":
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), value, norm_type=norm_type).item())
            else:
                # the largest |gradient|, by torch's max, which keeps a NaN (Python's max would drop one)
                norms.append(torch.stack([p.grad.abs().max() for p in model.parameters()]).max().item())
                torch.nn.utils.clip_grad_value_(model.parameters(), value)
        optimizer.step()
        states.append(clone_state(model))
    return states, losses, norms


def zero_worker(rank, world_size, stage, opt_name, accum, steps, clip=None):
    model = make_model()
    optimizer = make_optimizer(opt_name, model.parameters())
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    states, losses, norms = [], [], []
    for micro in make_batches(steps, accum, GLOBAL_BATCH):
        optimizer.zero_grad()
        for tokens in micro:
            loss = lm_loss(model, rank_slice(tokens, rank, world_size)) / accum
            loss.backward()
            losses.append(loss.item())
        with engine.step_window(optimizer):
            if clip is not None:
                kind, value, norm_type = clip
                if kind == "norm":
                    norms.append(engine.clip_grad_norm_(optimizer, value, norm_type=norm_type).item())
                else:
                    engine.clip_grad_value_(optimizer, value)
            optimizer.step()
        with engine.gathered_parameters():
            states.append(clone_state(model))
    return states, losses, norms


def _global_losses(results) -> list[float]:
    """The global-batch loss of each micro-step: the mean of the ranks' local (equal-sized) losses."""
    per_rank = [losses for _, losses, _ in results]
    return [sum(values) / len(values) for values in zip(*per_rank, strict=True)]


def _assert_ranks_agree(results) -> None:
    for rank, (states, _, _) in enumerate(results[1:], start=1):
        assert_state_close(states[-1], results[0][0][-1], rel=0.0, what=f"rank {rank} vs rank 0 after the last step")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("accum", ACCUMS)
@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_sgd_momentum_weight_decay_parity(stage, world_size, accum):
    ref_states, ref_losses, _ = reference_run("sgd", accum, STEPS)
    results = run_ranks(zero_worker, world_size, stage, "sgd", accum, STEPS, timeout_s=50)
    _assert_ranks_agree(results)
    for step, (got, ref) in enumerate(zip(results[0][0], ref_states, strict=True)):
        assert_state_close(got, ref, rel=1e-5, what=f"SGD stage {stage} world {world_size} accum {accum} step {step}")
    assert_values_close(_global_losses(results), ref_losses, rel=1e-5, what="losses", floor=ZERO_FLOOR)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("accum", ACCUMS)
@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_adamw_parity(stage, world_size, accum):
    """AdamW weights after the first step and after every later one, and the loss curve."""
    ref_states, ref_losses, _ = reference_run("adamw", accum, STEPS)
    results = run_ranks(zero_worker, world_size, stage, "adamw", accum, STEPS, timeout_s=50)
    _assert_ranks_agree(results)
    for step, (got, ref) in enumerate(zip(results[0][0], ref_states, strict=True)):
        assert_state_close(got, ref, rel=1e-5, what=f"AdamW stage {stage} world {world_size} step {step}")
    assert_values_close(_global_losses(results), ref_losses, rel=1e-5, what="losses", floor=ZERO_FLOOR)
    # the loss curve really moved (a run whose steps did nothing would fail above, but make it explicit)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_clip_grad_norm_parity(stage, world_size, norm_type):
    """The norm is global (every rank's slice, padding excluded) and the clipped update matches
    ``torch.nn.utils.clip_grad_norm_`` on the full gradients."""
    max_norm = 0.05 if norm_type == 2.0 else 0.01
    clip = ("norm", max_norm, norm_type)
    ref_states, _, ref_norms = reference_run("plain_sgd", 3, 3, clip)
    assert min(ref_norms) > 2 * max_norm, "the reference must actually clip for this test to mean anything"
    results = run_ranks(zero_worker, world_size, stage, "plain_sgd", 3, 3, clip, timeout_s=50)
    _assert_ranks_agree(results)
    for rank, (_, _, norms) in enumerate(results):
        assert_values_close(norms, ref_norms, rel=1e-5, what=f"rank {rank}'s total norms", floor=ZERO_FLOOR)
    for step, (got, ref) in enumerate(zip(results[0][0], ref_states, strict=True)):
        assert_state_close(got, ref, rel=1e-5, what=f"clip-by-norm stage {stage} world {world_size} step {step}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_clip_grad_value_parity(stage, world_size):
    clip = ("value", 2e-3, 0.0)
    ref_states, _, ref_max = reference_run("plain_sgd", 3, 3, clip)
    assert min(ref_max) > 4 * clip[1], "the reference must actually clip for this test to mean anything"
    results = run_ranks(zero_worker, world_size, stage, "plain_sgd", 3, 3, clip, timeout_s=50)
    _assert_ranks_agree(results)
    for step, (got, ref) in enumerate(zip(results[0][0], ref_states, strict=True)):
        assert_state_close(got, ref, rel=1e-5, what=f"clip-by-value stage {stage} world {world_size} step {step}")
