"""Reads of ``p.grad`` under ZeRO give DDP's values, at every stage, and cost nothing when nothing reads.

One launch of 2 processes runs DDP (``find_unused_parameters=True``) and ZeroEngine at stages 1/2/3 (stage 3 on
one host's shared memory and on ``collectives="point_to_point"``; stage 2 with the optimizer offloaded to host
memory, stage 3 to files) on the same model and data: accumulation over 2
micro-batches (the first under ``no_sync`` / ``gradients_held``), a parameter only rank 0 uses in the second
micro-batch, one no rank uses and a frozen one. At each point every parameter's ``p.grad`` is compared with DDP's:
after the held backward (this rank's own sum), after the synchronizing one (the average), Lightning's ``grad_norm``
over the module, after ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` (the clipped gradient is what
the step uses: the weights after the steps equal DDP's), after the step, and after ``zero_grad()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.compare import assert_state_close, assert_values_close
from helpers.grad_probe import STEPS, make_probe, micro_batches, probe_loss
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_in_process, run_ranks

MAX_NORM = 0.05  # below the gradients' norm: clipping changes them


def _grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def _observe(model: nn.Module, entry: nn.Module, rank: int, step: int, held: object, step_fn: object,
             zero_grad: object) -> dict:
    """The same reads under DDP and ZeRO; ``entry``: what forward runs through (DDP's wrapper); ``held``: a
    context for the first micro-batch's backward."""
    seen: dict = {}
    first, second = micro_batches(rank, step)
    with held():  # type: ignore[operator]
        probe_loss(entry, first, rank, second=False).backward()
    seen["held"] = _grads(model)
    probe_loss(entry, second, rank).backward()
    seen["synced"] = _grads(model)
    seen["norms"] = {k: v.clone() for k, v in lightning_grad_norm(model, 2).items()}
    seen["clip_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).clone()
    seen["clipped"] = _grads(model)
    step_fn()  # type: ignore[operator]
    seen["after_step"] = _grads(model)
    zero_grad()  # type: ignore[operator]
    seen["after_zero_grad"] = _grads(model)
    return seen


def _ddp_run(rank: int) -> dict:
    model, optimizer = make_probe()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    seen = [_observe(model, ddp, rank, s, ddp.no_sync, optimizer.step, optimizer.zero_grad) for s in range(STEPS)]
    return {"steps": seen, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _zero_run(rank: int, stage: int, collectives: str, offload: str = "none", nvme_dir: str | None = None) -> dict:
    model, optimizer = make_probe()
    config = ZeroConfig(stage=stage, collectives=collectives, offload_optimizer=offload, nvme_path=nvme_dir)
    engine = ZeroEngine(model, [optimizer], config)
    seen = [_observe(model, model, rank, s, engine.gradients_held, lambda: engine.optimizer_step(optimizer),
                     optimizer.zero_grad) for s in range(STEPS)]
    with engine.gathered_parameters():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.release()
    return {"steps": seen, "state": state}


def _runs(rank: int, world_size: int, nvme_dir: str) -> dict:
    runs: dict = {"ddp": _ddp_run(rank)}
    for stage, collectives in ((1, "auto"), (2, "auto"), (3, "auto"), (3, "point_to_point")):
        runs[(stage, collectives)] = _zero_run(rank, stage, collectives)
    runs[(2, "cpu offload")] = _zero_run(rank, 2, "auto", "cpu")  # the slices' gradients in host memory
    runs[(3, "nvme offload")] = _zero_run(rank, 3, "auto", "nvme", f"{nvme_dir}/{rank}")  # ...in files
    return runs


def _assert_grads_equal(got: dict, want: dict, where: str) -> None:
    assert list(got) == list(want), where
    for name, value in want.items():
        if value is None:
            assert got[name] is None, f"{where}: {name}.grad is not None where DDP's is"
            continue
        assert got[name] is not None, f"{where}: {name}.grad is None where DDP has one"
        assert_state_close({name: got[name]}, {name: value}, rel=1e-5, what=where)


@pytest.mark.timeout(180)
def test_p_grad_reads_equal_ddps_at_every_point(tmp_path: Path) -> None:
    results = run_ranks(_runs, 2, str(tmp_path), timeout_s=150)
    for rank, runs in enumerate(results):
        ddp = runs["ddp"]
        assert ddp["steps"][0]["synced"]["branch.weight"] is not None  # rank 1 too: DDP averages rank 0's
        assert ddp["steps"][0]["held"]["branch.weight"] is None and ddp["steps"][0]["synced"]["unused.weight"] is None
        for config, run in runs.items():
            if config == "ddp":
                continue
            for step, (got, want) in enumerate(zip(run["steps"], ddp["steps"], strict=True)):
                where = f"rank {rank}, {config}, step {step}"
                for point in ("held", "synced", "clipped", "after_step", "after_zero_grad"):
                    _assert_grads_equal(got[point], want[point], f"{where}, {point}")
                assert list(got["norms"]) == list(want["norms"]), where
                assert_state_close(got["norms"], want["norms"], rel=1e-5)
                assert_values_close([got["clip_norm"].item()], [want["clip_norm"].item()], rel=1e-5, what=where)
            assert_state_close(run["state"], ddp["state"], rel=1e-5)  # the clipped gradients were stepped


def _traffic(rank: int, world_size: int, stage: int, read: bool) -> tuple[dict[str, int], int, int]:
    """Bytes per kind of exchange over the steps, the most module gradients torch held after a backward, and the
    bytes of the fp32 gradients of the stepped FlatParams (what one read's gather moves)."""
    model, optimizer = make_probe()
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    held = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        for batch in micro_batches(rank, step):
            probe_loss(model, batch, rank).backward()
        if read:
            assert model.inp.weight.grad is not None
            assert model.out.weight.grad is not None  # the second read gathers nothing
        with torch._C.DisableTorchFunctionSubclass():  # torch's attribute, not a read
            held = max(held, sum(p.grad is not None for p in model.parameters()))
        engine.optimizer_step(optimizer)
    log = engine.comm_log.snapshot()
    gradient_bytes = sum(4 * f.layout.padded_numel for f in engine.flat_params if f.trainable and f.optimizers)
    engine.release()
    return log, held, gradient_bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_module_that_reads_no_gradient_pays_nothing(stage: int) -> None:
    quiet, held, gradient_bytes = run_in_process(_traffic, 2, stage, False)[0]
    reading, _, _ = run_in_process(_traffic, 2, stage, True)[0]
    if stage > 1:
        assert held == 0  # stages 2/3 keep no module gradient after backward (stage 1 keeps them to the step)
    extra = {kind: reading.get(kind, 0) - quiet.get(kind, 0) for kind in set(reading) | set(quiet)}
    assert extra.pop("all_gather") == STEPS * gradient_bytes, extra  # one gather of the fp32 gradients per step
    # the rest is the used-parameter agreement a read makes before it gathers (a few bytes), nothing else
    assert all(0 <= value <= 64 * STEPS for value in extra.values()), extra
