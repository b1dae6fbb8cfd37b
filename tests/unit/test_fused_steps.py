"""Fused optimizer steps (ZeroConfig.fused_optimizer): the user's Adam/AdamW/SGD/Adagrad runs torch's fused kernel
on the master slices, within fp32 rounding of the default loop; explicit choices and the option are respected.

World size 1 runs the engine's own code path in this process. The reference is a plain model stepped by a torch
optimizer with torch's default implementation (the per-tensor loop on CPU), never touching zero_strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import assert_state_close, clone_state, lm_loss, make_batches, make_model, max_rel_err
from torch.optim import Optimizer

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine

STEPS = 6


class FusedSpy:
    """Records, for every ``optimizer.step()`` call, each group's ``fused`` value as the step sees it (a pre-hook
    registered after the engine's, so it runs after the engine chose)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.seen: list[tuple[Any, ...]] = []
        optimizer.register_step_pre_hook(self._record)

    def _record(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.seen.append(tuple(group["fused"] for group in optimizer.param_groups))


def make_optimizer(name: str, params: Any, **explicit: Any) -> Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, **explicit)
    if name == "adam_amsgrad":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.01, amsgrad=True, **explicit)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **explicit)
    return torch.optim.Adagrad(params, lr=0.1, lr_decay=0.01, weight_decay=0.01, **explicit)


def train(
    name: str, config: ZeroConfig | None, skip_first: bool = False, **explicit: Any
) -> tuple[dict, list, Optimizer]:
    """STEPS steps of ``name``: under a world-size-1 ZeroEngine (``config``), or plain torch (``config`` None).
    ``skip_first``: blocks.0 produces no gradient in the first step (so the optimizer first steps it in the second)."""
    model = make_model()
    optimizer = make_optimizer(name, model.parameters(), **explicit)
    engine = ZeroEngine(model, [optimizer], config) if config is not None else None
    spy = FusedSpy(optimizer)
    for index, (tokens,) in enumerate(make_batches(STEPS, 1, 4)):
        optimizer.zero_grad()
        model.blocks[0].requires_grad_(not (skip_first and index == 0))
        lm_loss(model, tokens).backward()
        if engine is not None:
            engine.optimizer_step(optimizer)
        else:
            optimizer.step()
    if engine is None:
        return clone_state(model), spy.seen, optimizer
    with engine.gathered_parameters():  # stage 3 keeps only slices between steps
        return clone_state(model), spy.seen, optimizer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["adamw", "adam_amsgrad", "sgd", "adagrad"])
def test_fused_kernel_steps_the_slices_within_rounding(name: str) -> None:
    reference, ref_seen, _ = train(name, None)
    assert all(fused in (None, False) for step in ref_seen for fused in step)  # torch's default loop
    for stage in (1, 3):
        got, seen, optimizer = train(name, ZeroConfig(stage=stage))
        assert seen == [(True,)] * STEPS, f"{name} stage {stage}: the fused kernel did not run ({seen})"
        # between steps the group holds the user's own setting again (state_dict, checkpoints record it)
        assert optimizer.param_groups[0]["fused"] is None
        assert optimizer.state_dict()["param_groups"][0]["fused"] is None
        err, where = max_rel_err(got, reference)
        print(f"{name} stage {stage}: fused vs default loop after {STEPS} steps, max relative difference "
              f"{err:.1e} ({where})")
        assert_state_close(got, reference, rel=1e-5, what=f"{name} stage {stage} fused")


@pytest.mark.timeout(60)
def test_explicit_choices_and_the_option_are_respected() -> None:
    for explicit, option, expected in [
        ({"fused": False}, True, False),  # the user forced the loop
        ({"foreach": False}, True, None),  # torch's documented way to force the loop too
        ({"foreach": True}, True, None),
        ({"fused": True}, False, True),  # the user's own fused=True stays, even with the option off
        ({}, False, None),  # the option off: torch's default
    ]:
        _, seen, _ = train("adamw", ZeroConfig(stage=2, fused_optimizer=option), **explicit)
        assert seen == [(expected,)] * STEPS, (explicit, option, seen)


@pytest.mark.timeout(60)
def test_sgd_momentum_piece_without_buffer_runs_the_default_loop_once() -> None:
    """Fused SGD needs the momentum buffers of all stepped pieces or of none. blocks.0 has no gradient in step 1,
    so its piece gets its first step (and buffer) in step 2 while the other pieces have theirs: that one step runs
    torch's default loop; every other step is fused."""
    reference, _, _ = train("sgd", None, skip_first=True)
    got, seen, _ = train("sgd", ZeroConfig(stage=1), skip_first=True)
    assert seen == [(True,), (None,)] + [(True,)] * (STEPS - 2), seen
    assert_state_close(got, reference, rel=1e-5, what="sgd, blocks.0 stepped first in step 2")


@pytest.mark.timeout(60)
def test_nvme_chunked_steps_are_fused(tmp_path: Path) -> None:
    reference, _, _ = train("adamw", None)
    config = ZeroConfig(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=str(tmp_path),
                        nvme_chunk_numel=1024)
    got, seen, _ = train("adamw", config)
    assert len(seen) >= STEPS and all(step == (True,) for step in seen), seen  # every chunk's call is fused
    assert_state_close(got, reference, rel=1e-5, what="nvme chunked, fused")
