"""bf16/fp16 at every stage against an independent single-process computation of the same math.

The reference keeps an fp32 master model; each step it copies the masters into a compute model (low precision
except normalization layers), runs each rank's micro-batches under autocast, converts the gradients to fp32,
averages them over ranks and accumulates them in fp32, then steps the fp32 masters. ZeRO must reproduce that up
to fp32 summation order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.compare import assert_state_close
from torch import nn

from zero_strategy import ZeroConfig, ZeroEngine, ZeroPrecision
from zero_strategy.core.plan.precision import NORMALIZATION_LAYERS
from zero_strategy.testing import run_ranks

WORLD, STEPS, ACCUM, PER_RANK = 2, 3, 2, 4
FP16_SCALE = 2.0**4  # a static loss scale other than 1: a step that forgot to unscale cannot match the reference


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batches() -> torch.Tensor:
    return torch.randint(0, 12, (STEPS, ACCUM, WORLD * PER_RANK, 7), generator=torch.Generator().manual_seed(3))


def loss_of(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, 12), x[:, 1:].reshape(-1)) / ACCUM


def reference(dtype: torch.dtype, loss_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """``loss_scale``: backward of the scaled loss, its gradients divided by it in fp32 (what torch's GradScaler
    does; fp16 gradients of the scaled loss underflow less than those of the loss itself)."""
    torch.manual_seed(0)
    master = Net()
    opt = torch.optim.SGD(master.parameters(), lr=0.3, momentum=0.9)
    for step in batches():
        compute = copy.deepcopy(master)
        for module in compute.modules():
            if not isinstance(module, NORMALIZATION_LAYERS):
                for param in module.parameters(recurse=False):
                    param.data = param.data.to(dtype)
        grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        for micro in step:
            for rank in range(WORLD):
                compute.zero_grad()
                (loss_of(compute, micro[rank * PER_RANK : (rank + 1) * PER_RANK], dtype) * loss_scale).backward()
                for name, param in compute.named_parameters():
                    grads[name] += param.grad.float() / loss_scale / WORLD
        for name, param in master.named_parameters():
            param.grad = grads[name]
        opt.step()
    return {k: v.clone() for k, v in master.state_dict().items()}


def zero_run(rank: int, world: int, stage: int, precision: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    plugin = ZeroPrecision(precision, loss_scale=FP16_SCALE if precision == "16-mixed" else 0.0)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, min_unit_numel=10**9), policy=plugin.policy())
    plugin.attach(engine)
    for step in batches():

        def closure(step: torch.Tensor = step) -> torch.Tensor:
            opt.zero_grad()
            for micro in step:
                loss = loss_of(model, micro[rank * PER_RANK : (rank + 1) * PER_RANK], plugin.compute_dtype)
                (loss * plugin.loss_scale).backward()
            return loss

        plugin.optimizer_step(opt, model=model, closure=closure)
    engine.release()  # the module gets the fp32 master weights back
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_low_precision_matches_reference_at_every_stage(precision: str) -> None:
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    expected = reference(dtype, FP16_SCALE if precision == "16-mixed" else 1.0)
    for stage in (1, 2, 3):
        got = run_ranks(zero_run, WORLD, stage, precision, timeout_s=60)[0]
        assert_state_close(got, expected, rel=1e-5, what=f"stage {stage}", floor=1e-3)
