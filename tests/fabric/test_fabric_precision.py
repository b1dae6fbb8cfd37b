"""Fabric's precision strings reach ZeRO's precision logic: ``Fabric(precision="bf16-mixed" | "16-mixed")`` under a
ZeRO strategy computes in that dtype with fp32 masters (fp16 really in fp16 on a CPU, where Fabric alone switches
to bf16), matching the independent single-process reference of tests/precision at every stage; and an fp16 step
whose gradients overflow on one rank is skipped on every rank, changing nothing, while the loss scale halves."""

from __future__ import annotations

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from lightning.fabric import Fabric
from precision.test_precision_parity import ACCUM, PER_RANK, Net, batches, loss_of, reference

from zero_strategy import ZeroFabricPrecision, ZeroFabricStrategy
from zero_strategy.testing import run_ranks

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _run(fabric: Fabric, steps: list[int], overflow_at: int | None = None,
         scale_after_first: float | None = None) -> tuple[dict, object]:
    """SGD with momentum over the given steps of tests/precision's batches; ``overflow_at``: rank 1's loss of that
    step is infinite (an fp16 overflow on one rank only); ``scale_after_first``: the loss scale from the second
    step on (the reference for a skipped step runs at the scale the skipping run's scaler chose)."""
    torch.manual_seed(0)
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9))
    dtype = DTYPES.get(fabric.strategy.precision.precision, torch.float32)
    rank = fabric.global_rank
    data = batches()
    for step in steps:
        for micro_index, micro in enumerate(data[step]):
            with fabric.no_backward_sync(model, enabled=micro_index < ACCUM - 1):
                loss = loss_of(model, micro[rank * PER_RANK : (rank + 1) * PER_RANK], dtype)
                if step == overflow_at and rank == 1:
                    loss = loss * float("inf")
                fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1e6)  # an overflowing step must not raise here
        optimizer.step()
        optimizer.zero_grad()
        if scale_after_first is not None and step == steps[0]:
            fabric.strategy.precision.scaler.scale = scale_after_first
    fabric.strategy.engine(model).release(full=True)  # the module's parameters become the fp32 masters
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, fabric.strategy.precision


def each_precision(rank: int, world: int) -> dict:
    as_launched_rank(rank, world)
    out: dict = {}
    for precision in DTYPES:
        for stage in (1, 2, 3):
            fabric = Fabric(strategy=f"zero{stage}", accelerator="cpu", devices=world, precision=precision)
            fabric.launch()
            plugin = fabric.strategy.precision
            out[(precision, stage, "plugin")] = (type(plugin).__name__, plugin.precision, plugin.loss_scale)
            out[(precision, stage)] = _run(fabric, [0, 1, 2])[0]
            if precision == "16-mixed":  # the reference scales by 1: a static scale of 1 too, besides 2^16
                fabric = Fabric(strategy=f"zero{stage}", accelerator="cpu", devices=world,
                                plugins=[ZeroFabricPrecision("16-mixed", loss_scale=1.0)])
                fabric.launch()
                out[(precision, stage, "scale 1")] = _run(fabric, [0, 1, 2])[0]
    for stage in (2, 3):
        runs = []
        for steps, overflow_at, scale in (([0, 1, 2], 1, None), ([0, 2], None, 8.0)):
            plugin = ZeroFabricPrecision("16-mixed", initial_scale_power=4, hysteresis=1)
            fabric = Fabric(strategy=ZeroFabricStrategy(stage=stage), accelerator="cpu", devices=world,
                            plugins=[plugin])
            fabric.launch()
            weights, used = _run(fabric, steps, overflow_at, scale)
            runs.append((weights, used.loss_scale, used.skipped_steps))
        out[("skipped", stage)] = runs
    return out


@pytest.mark.timeout(180)
def test_precision_strings_and_skipped_fp16_steps() -> None:
    results = run_ranks(each_precision, 2, timeout_s=150)
    got = results[0]
    for precision, dtype in DTYPES.items():
        expected = reference(dtype)
        for stage in (1, 2, 3):
            initial_scale = 2.0**16 if precision == "16-mixed" else 1.0  # fp16: the dynamic loss scaler
            assert got[(precision, stage, "plugin")] == ("ZeroFabricPrecision", precision, initial_scale)
            # fp16's dynamic scale (2^16) keeps gradients the reference (scale 1) lets underflow: 2e-4 apart here
            runs = [(got[(precision, stage)], 1e-5 if precision == "bf16-mixed" else 1e-3)]
            if precision == "16-mixed":
                runs.append((got[(precision, stage, "scale 1")], 1e-5))
            for run, limit in runs:
                assert_state_close(run, expected, rel=limit, what=f"{precision}, stage {stage}", floor=1e-3)
    for stage in (2, 3):
        (skipped, skipped_scale, skipped_count), (without, _, count) = got[("skipped", stage)]
        assert (skipped_count, count) == (1, 0), f"stage {stage}: the overflowing step was skipped, once"
        assert skipped_scale == 8.0, f"stage {stage}: the scale halves on the overflow (from 16)"
        for key, value in without.items():  # the skipped step changed nothing: weights, momentum, step count
            assert torch.equal(skipped[key], value), f"stage {stage}: {key} moved in the skipped step"
        for other in results[1:]:
            assert all(torch.equal(other[("skipped", stage)][0][0][k], v) for k, v in skipped.items())
