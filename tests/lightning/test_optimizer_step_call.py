"""The user's optimizer's ``step`` receives the call Lightning's DDP path makes (``closure=`` with every precision but
16-mixed, whose GradScaler calls ``step()``), in automatic and manual optimization, at every stage, stage 3 on both
transports, on 1 and 2 processes: a wrapper of ``step`` records each call, compared with DDP's in the same run, and
the weights stay DDP's (see [Note: the closure the optimizer's step receives] in zero_strategy/lightning/precision.py).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.models import TiedLM, lm_loss
from lightning.pytorch.plugins.precision import MixedPrecision

from zero_strategy import ZeroStrategy
from zero_strategy.lightning.precision import ZeroPrecision
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: ZeroStrategy(stage=3, collectives="auto"),
    "zero3_point_to_point": lambda: ZeroStrategy(stage=3, collectives="point_to_point"),
}
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed"]
# fp32: the same arithmetic as DDP's; mixed: ZeRO's compute copies round where DDP's autocast does (3 steps of SGD)
TOLERANCE = {"32-true": (1e-5, 1e-6), "bf16-mixed": (2e-2, 2e-2), "16-mixed": (2e-3, 2e-3)}


class RecordedSteps(pl.LightningModule):
    """The optimizer's ``step`` is wrapped, as a user's wrapper or mock would, to record each call it receives."""

    def __init__(self, automatic: bool) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.automatic_optimization = automatic
        self.calls: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        _, tokens = batch
        loss = lm_loss(self.net, tokens)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        step = optimizer.step

        def recording_step(*args: Any, **kwargs: Any) -> Any:
            closure = kwargs.get("closure")
            returned = step(*args, **kwargs)
            self.calls.append({
                "positional": len(args),
                "keywords": sorted(kwargs),
                "closure_callable": callable(closure),
                "returned": None if returned is None else float(returned),
            })
            return returned

        optimizer.step = recording_step  # type: ignore[method-assign]
        return optimizer


def _precision_settings(strategy: str, precision: str) -> dict[str, Any]:
    """The Trainer's precision. On a CPU Lightning turns DDP's "16-mixed" into "bf16-mixed", so DDP's fp16 reference
    is its own plugin, given explicitly (torch's GradScaler on the CPU); both scalers start at 2**8, where this model
    does not overflow, so that every step runs on both."""
    if precision != "16-mixed":
        return {"precision": precision}
    if strategy == "ddp":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))]}
    return {"plugins": [ZeroPrecision("16-mixed", initial_scale_power=8)]}


def fit_each(rank: int, world: int, precision: str) -> dict[str, Any]:
    as_launched_rank(rank, world)
    out: dict[str, Any] = {}
    for name, make in {"ddp": lambda: "ddp", **STRATEGIES}.items():
        for automatic in (True, False):
            pl.seed_everything(0, verbose=False)
            module = RecordedSteps(automatic)
            trainer = pl.Trainer(strategy=make(), accelerator="cpu", devices=world, max_steps=3,
                                 **_precision_settings(name, precision), logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(module, loader(4 * 3 * world, 21))
            weights = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
            out[f"{name}/{'automatic' if automatic else 'manual'}"] = {"calls": module.calls, "weights": weights}
    return out


@pytest.fixture(scope="module", params=[(w, p) for w in (1, 2) for p in PRECISIONS],
                ids=[f"{w}_process{'es' if w > 1 else ''}-{p}" for w in (1, 2) for p in PRECISIONS])
def runs(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    world, precision = request.param
    return precision, run_ranks(fit_each, world, precision, timeout_s=400)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimization", ["automatic", "manual"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_step_receives_ddps_call_and_the_weights_stay_ddps(
    runs: tuple[str, list[dict]], strategy: str, optimization: str
) -> None:
    precision, results = runs
    rtol, atol = TOLERANCE[precision]
    for rank, result in enumerate(results):
        ddp, got = result[f"ddp/{optimization}"], result[f"{strategy}/{optimization}"]
        assert len(ddp["calls"]) > 0, "DDP's run stepped"
        shape = [{k: v for k, v in call.items() if k != "returned"} for call in got["calls"]]
        assert shape == [{k: v for k, v in call.items() if k != "returned"} for call in ddp["calls"]], (rank, shape)
        returned = [call["returned"] for call in got["calls"]]
        expected = [call["returned"] for call in ddp["calls"]]
        assert [r is None for r in returned] == [e is None for e in expected], (returned, expected)
        torch.testing.assert_close([r for r in returned if r is not None], [e for e in expected if e is not None],
                                   rtol=rtol, atol=atol)
        for key, value in ddp["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=rtol, atol=atol,
                                       msg=lambda m, k=key, n=rank: f"rank {n} {k}: {m}")
