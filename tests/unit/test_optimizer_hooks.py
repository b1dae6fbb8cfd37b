"""What ZeRO installs on the user's objects (an instance-level ``zero_grad`` on each optimizer, an instance-level
``lr_scheduler_step`` on the LightningModule under fp16) keeps their classes, survives pickle and deepcopy, and is
removed, idempotently. World size 1 in this process."""

from __future__ import annotations

import copy
import pickle

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import lm_loss, make_batches, make_model
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.model_helpers import is_overridden as pl_is_overridden
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.lightning.schedule_hold import hold_back_lr_schedulers, release_lr_schedulers


@pytest.mark.timeout(20)
def test_zero_grad_hook_keeps_the_class_reaches_stage1_gradients_and_is_removed():
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=1))
    assert type(optimizer) is torch.optim.AdamW
    assert engine.optimizer_index(LightningOptimizer(optimizer)) == 0  # what manual optimization hands out
    (tokens,) = next(iter(make_batches(1, 1, 4)))
    lm_loss(model, tokens).backward()
    assert any(p.grad is not None for p in model.parameters())  # stage 1 keeps them on the module until the step
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # the engine's callback ran
    for clone in (pickle.loads(pickle.dumps(optimizer)), copy.deepcopy(optimizer)):
        assert type(clone) is torch.optim.AdamW and "zero_grad" not in vars(clone)
    engine.release()
    engine.release()  # idempotent
    assert "zero_grad" not in vars(optimizer)


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


@pytest.mark.timeout(20)
def test_lr_scheduler_hold_back_steps_only_when_allowed_and_stays_picklable():
    module = Plain()
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(module.parameters(), lr=1.0), step_size=1)
    held = {"now": True}
    hold_back_lr_schedulers(module, lambda s: held["now"] and s is scheduler)
    hold_back_lr_schedulers(module, lambda s: held["now"] and s is scheduler)  # idempotent
    module.lr_scheduler_step(scheduler, None)
    assert scheduler.last_epoch == 0  # held back
    held["now"] = False
    module.lr_scheduler_step(scheduler, None)
    assert scheduler.last_epoch == 1  # the class's hook ran
    assert not pl_is_overridden("lr_scheduler_step", module)  # Lightning still sees the class's own hook
    for clone in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert type(clone) is Plain
        other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(clone.parameters(), lr=1.0), step_size=1)
        clone.lr_scheduler_step(other, None)  # a copy just runs the class's hook
        assert other.last_epoch == 1
    release_lr_schedulers(module)
    release_lr_schedulers(module)  # idempotent
    assert "lr_scheduler_step" not in vars(module)
    assert set(scheduler.state_dict()) == set(
        torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))]), step_size=1).state_dict()
    )
