"""Which optimizers ZeRO accepts, and that accepted element-wise optimizers step exactly as on whole tensors
(world size 1 runs the same code path in this process: collectives degenerate to copies)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import assert_state_close, clone_state, lm_loss, make_batches, make_model
from helpers.storage import optimizer_params

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.optimizer import UnsupportedOptimizerError


class CustomOptimizer(torch.optim.Optimizer):
    """A user's optimizer that ZeRO has never heard of (here plain SGD, so allowing it is safe)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class MySGD(torch.optim.SGD):
    """A subclass of a listed optimizer may override anything: it is not trusted by inheritance."""


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lbfgs_refused_with_its_name(stage):
    model = make_model()
    before = [(p.untyped_storage().data_ptr(), p.detach().clone()) for p in model.parameters()]
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        ZeroEngine(model, [torch.optim.LBFGS(model.parameters())], ZeroConfig(stage=stage))
    # refused before anything was sharded: the model is untouched
    for (ptr, value), p in zip(before, model.parameters(), strict=True):
        assert p.untyped_storage().data_ptr() == ptr
        torch.testing.assert_close(p.detach(), value, rtol=0, atol=0)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("cls", [CustomOptimizer, MySGD], ids=["custom", "sgd_subclass"])
def test_unlisted_optimizer_refused_unless_allowed(cls):
    model = make_model()
    with pytest.raises(UnsupportedOptimizerError, match=cls.__name__) as info:
        ZeroEngine(model, [cls(model.parameters(), lr=0.1)], ZeroConfig(stage=2))
    assert "allow_untested_optimizer" in str(info.value)  # the message says how to opt in
    assert isinstance(info.value, TypeError)

    model = make_model()
    optimizer = cls(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2, allow_untested_optimizer=True))
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for (tokens,) in make_batches(2, 1, 4):
        optimizer.zero_grad()
        lm_loss(model, tokens).backward()
        engine.optimizer_step(optimizer)
        ref_opt.zero_grad()
        lm_loss(reference, tokens).backward()
        ref_opt.step()
    assert_state_close(clone_state(model), clone_state(reference), what=cls.__name__)


@pytest.mark.timeout(20)
def test_sparse_adam_refused():
    model = make_model()
    with pytest.raises(UnsupportedOptimizerError, match="SparseAdam"):
        ZeroEngine(model, [torch.optim.SparseAdam(list(model.parameters()))], ZeroConfig(stage=1))


ELEMENTWISE = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(ELEMENTWISE))
@pytest.mark.parametrize("stage", [1, 3])
def test_elementwise_optimizers_accepted_and_exact(name, stage):
    """Same weights as the plain optimizer on whole tensors after 3 steps; the optimizer keeps its identity and
    now steps the master slices (no module parameter left in its groups)."""
    make = ELEMENTWISE[name]
    model = make_model()
    optimizer = make(model.parameters())
    groups_before = optimizer.param_groups
    module_param_ids = {id(p) for p in model.parameters()}
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    assert optimizer.param_groups is groups_before
    assert not module_param_ids & {id(p) for p in optimizer_params(optimizer)}
    reference = make_model()
    ref_opt = make(reference.parameters())
    for (tokens,) in make_batches(3, 1, 4):
        optimizer.zero_grad()
        lm_loss(model, tokens).backward()
        engine.optimizer_step(optimizer)
        ref_opt.zero_grad()
        lm_loss(reference, tokens).backward()
        ref_opt.step()
    with engine.gathered_parameters():
        got = clone_state(model)
    assert_state_close(got, clone_state(reference), what=f"{name} stage {stage}")
