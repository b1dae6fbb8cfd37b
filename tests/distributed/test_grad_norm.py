"""``zero_strategy.grad_norm`` against Lightning's ``grad_norm`` under DDP (reads of ``p.grad`` themselves:
test_ddp_grad_reads.py).

The DDP run and the ZeRO runs share one launch of 2 processes: accumulation over 2 micro-batches (DDP's first under
``no_sync``), a parameter only rank 0 uses (DDP(find_unused_parameters=True) averages zeros from rank 1), one no
rank uses and a frozen one (both left out), norm types 2, 1 and inf, at the point where DDP's gradients are
synchronized (after the window's last backward, where Lightning's ``on_before_optimizer_step`` reads them), at
zero1/2/3 and stage 3 on both transports. Mid-window ZeRO's norms are those of the average accumulated so far."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.grad_probe import STEPS, Probe, make_probe, micro_batches, probe_loss
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import zero_strategy
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks

NORMS = (2, 1, "inf")


def _all_norms(module: nn.Module, norm: object) -> dict[str, Tensor]:
    return {k: v.clone() for n in NORMS for k, v in (norm(module, n)).items()}  # type: ignore[operator]


def _ddp_run(rank: int) -> dict:
    model, optimizer = make_probe()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    seen: dict = {"mid": [], "end": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        first, second = micro_batches(rank, step)
        with ddp.no_sync():
            probe_loss(ddp, first, rank, second=False).backward()
        seen["mid"].append(_all_norms(_averaged(model), lightning_grad_norm))
        probe_loss(ddp, second, rank).backward()
        seen["end"].append(_all_norms(model, lightning_grad_norm))
        optimizer.step()
    seen["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return seen


def _averaged(model: Probe) -> Probe:
    """A copy of ``model`` holding the gradients averaged over the ranks so far (zeros from a rank without one):
    what ZeRO reports mid-window, where DDP's own are each rank's."""
    averaged = copy.deepcopy(model)
    for param, copied in zip(model.parameters(), averaged.parameters(), strict=True):
        if not param.requires_grad:
            continue
        grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        produced = torch.tensor([float(param.grad is not None)])
        dist.all_reduce(grad)
        dist.all_reduce(produced)
        copied.grad = grad / dist.get_world_size() if produced.item() > 0 else None
    return averaged


def _zero_run(rank: int, stage: int, collectives: str) -> dict:
    model, optimizer = make_probe()
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives=collectives))
    seen: dict = {"mid": [], "end": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        first, second = micro_batches(rank, step)
        probe_loss(model, first, rank, second=False).backward()
        seen["mid"].append(_all_norms(model, zero_strategy.grad_norm))  # stage 1 reduces early, the step is the same
        probe_loss(model, second, rank).backward()
        with engine.step_window(optimizer):  # where Lightning calls on_before_optimizer_step
            seen["end"].append(_all_norms(model, zero_strategy.grad_norm))
            engine.step(optimizer)
    with engine.gathered_parameters():
        seen["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.release()
    return seen


def _runs(rank: int, world_size: int) -> dict:
    runs = {"ddp": _ddp_run(rank)}
    for stage, collectives in ((1, "auto"), (2, "auto"), (3, "auto"), (3, "point_to_point")):
        runs[(stage, collectives)] = _zero_run(rank, stage, collectives)
    return runs


def _assert_norms_equal(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
    for key, value in want.items():
        assert got[key].shape == value.shape == ()
        assert abs(got[key].item() - value.item()) <= 1e-5 * max(1.0, abs(value.item())), f"{what}: {key}"


@pytest.mark.timeout(120)
def test_grad_norm_equals_lightnings_under_ddp() -> None:
    results = run_ranks(_runs, 2, timeout_s=100)
    ddp = results[0]["ddp"]
    keys = list(ddp["end"][0])
    assert "grad_2.0_norm/branch.weight" in keys and "grad_inf_norm_total" in keys
    assert "grad_2.0_norm/branch.weight" not in ddp["mid"][0]
    assert not any("unused" in key or "frozen" in key for key in keys)
    for rank, runs in enumerate(results):
        assert list(runs["ddp"]["end"][0]) == keys  # DDP gives rank 1 the branch's averaged gradient too
        for config, seen in runs.items():
            if config == "ddp":
                continue
            for step in range(STEPS):
                where = f"rank {rank}, {config}, step {step}"
                _assert_norms_equal(seen["end"][step], runs["ddp"]["end"][step], f"{where}, before the step")
                _assert_norms_equal(seen["mid"][step], runs["ddp"]["mid"][step], f"{where}, mid-window")
            for key, value in runs["ddp"]["state"].items():  # reading the norms changed nothing of the steps
                torch.testing.assert_close(seen["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"{config} {key}")


def test_without_an_engine_it_is_lightnings() -> None:
    model, _ = make_probe()
    probe_loss(model, micro_batches(0, 0)[0], 0).backward()
    _assert_norms_equal(_all_norms(model, zero_strategy.grad_norm), _all_norms(model, lightning_grad_norm), "local")
    assert zero_strategy.grad_norm(Probe().unused, 2) == {}
    with pytest.raises(ValueError, match="positive number or 'inf'"):
        zero_strategy.grad_norm(model, 0)
