"""Through the Trainer, as under DDP: a gradient replaced by assignment in ``on_before_optimizer_step`` or after
``manual_backward`` (``p.grad = t``, ``p.grad = None``) is what the optimizer steps; and with fp16 a step the loss
scale skips still runs ``on_before_optimizer_step`` and clipping, whose ``p.grad`` reads the non-finite unscaled
gradients, then nothing moves; a read inside an accumulation window in ``on_train_batch_end`` is DDP's own sum
(zero1 keeps it; zero2/3 hold the window's gradients for a module overriding that hook: see
tests/lightning/test_window_grad_reads.py). DDP runs in the same launch; zero1/2/3, stage 3 on one host's
shared memory and on ``collectives="point_to_point"``; 1 and 2 processes.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.compare import assert_same_non_finite, assert_state_close
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.models import TiedLM, lm_loss
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor

from zero_strategy import ZeroStrategy
from zero_strategy.lightning.precision import ZeroPrecision
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: ZeroStrategy(stage=3, collectives="auto"),
    "zero3_point_to_point": lambda: ZeroStrategy(stage=3, collectives="point_to_point"),
}
POISONED_STEP = 1  # fp16: the loss of this step is inf on the last rank; every rank's step is skipped


def _grads(module: torch.nn.Module) -> dict[str, Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().float().clone() for name, p in module.named_parameters()}


class AssignsGradients(pl.LightningModule):
    """Replaces gradients where real code does: in on_before_optimizer_step (automatic) or between manual_backward
    and opt.step() (manual). Records p.grad before and after, per step."""

    def __init__(self, automatic: bool) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.automatic_optimization = automatic
        self.seen: list[dict[str, Tensor | None]] = []

    def _assign(self) -> None:
        self.seen.append(_grads(self))
        fc = self.net.blocks[0].fc
        fc.weight.grad = fc.weight.grad * -1.5 + 0.01
        self.net.blocks[1].fc.bias.grad = None  # the step skips it: SGD's momentum leaves it alone
        self.seen.append(_grads(self))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        loss = lm_loss(self.net, batch[1])
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self._assign()
        opt.step()
        return None

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.automatic_optimization:
            self._assign()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class OverflowsOnce(pl.LightningModule):
    """fp16: the loss of one step is inf on the last rank; on_before_optimizer_step records every call's
    gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.seen: list[tuple[int, dict[str, Tensor | None]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = lm_loss(self.net, batch[1])
        if self.global_step == POISONED_STEP and self.global_rank == self.trainer.world_size - 1:
            loss = loss * float("inf")
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append((self.global_step, _grads(self)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ReadsInWindow(pl.LightningModule):
    """Accumulation over 2 micro-batches; p.grad read in on_train_batch_end, inside the window after the first
    (DDP: this rank's own sum) and at its end, without overriding on_after_backward (overriding on_train_batch_end
    makes zero2/3 hold the window's gradients by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.seen: list[dict[str, Tensor | None]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return lm_loss(self.net, batch[1])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(_grads(self))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _trainer(strategy: Any, world: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _fp16(strategy: str) -> Any:
    """On a CPU Lightning turns DDP's "16-mixed" into "bf16-mixed": DDP's fp16 reference is its own plugin with
    torch's GradScaler; both scales start at 2**8, where only the poisoned step overflows."""
    if strategy == "ddp":
        return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))
    return ZeroPrecision("16-mixed", initial_scale_power=8)


def fit_each(rank: int, world: int) -> dict:
    as_launched_rank(rank, world)
    out: dict = {}
    for name, make in {"ddp": lambda: "ddp", **STRATEGIES}.items():
        for automatic in (True, False):
            pl.seed_everything(0, verbose=False)
            module = AssignsGradients(automatic)
            _trainer(make(), world).fit(module, loader(4 * 3 * world, 21))
            out[(name, "automatic" if automatic else "manual")] = {
                "seen": module.seen, "weights": {k: v.detach().clone() for k, v in module.state_dict().items()}}
        pl.seed_everything(0, verbose=False)
        reader = ReadsInWindow()
        try:
            _trainer(make(), world, accumulate_grad_batches=2).fit(reader, loader(4 * 4 * world, 21))
            out[(name, "window")] = {"seen": reader.seen}
        except Exception as error:  # what each rank sees is the result
            out[(name, "window")] = {"error": f"{type(error).__name__}: {error}"}
        pl.seed_everything(0, verbose=False)
        module = OverflowsOnce()
        trainer = _trainer(make(), world, plugins=[_fp16(name)], gradient_clip_val=1.0)
        trainer.fit(module, loader(4 * 3 * world, 21))
        out[(name, "fp16")] = {"seen": module.seen,
                               "weights": {k: v.detach().float().clone() for k, v in module.state_dict().items()}}
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def runs(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(fit_each, request.param, timeout_s=500)


def _assert_grads(got: dict, want: dict, where: str, rel: float) -> None:
    assert list(got) == list(want), where
    for name, value in want.items():
        if value is None:
            assert got[name] is None, f"{where}: {name}.grad is not None where DDP's is"
            continue
        assert got[name] is not None, f"{where}: {name}.grad is None where DDP has one"
        assert_state_close({name: got[name]}, {name: value}, rel=rel, what=where)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("optimization", ["automatic", "manual"])
def test_an_assigned_gradient_is_what_the_optimizer_steps(runs: list[dict], strategy: str,
                                                          optimization: str) -> None:
    for rank, result in enumerate(runs):
        ddp, got = result[("ddp", optimization)], result[(strategy, optimization)]
        assert len(ddp["seen"]) == 6 and ddp["seen"][1]["net.blocks.1.fc.bias"] is None  # 3 steps, 2 records
        assert len(got["seen"]) == len(ddp["seen"]), f"rank {rank}: {len(got['seen'])} records"
        for index, (mine, theirs) in enumerate(zip(got["seen"], ddp["seen"], strict=True)):
            _assert_grads(mine, theirs, f"rank {rank}, {strategy}, {optimization}, record {index}", 1e-5)
        assert_state_close(got["weights"], ddp["weights"], rel=1e-5, what=f"rank {rank}, {strategy}")


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_skipped_fp16_step_runs_on_before_optimizer_step(runs: list[dict], strategy: str) -> None:
    for rank, result in enumerate(runs):
        ddp, got = result[("ddp", "fp16")], result[(strategy, "fp16")]
        steps = [step for step, _ in ddp["seen"]]
        assert steps == [0, POISONED_STEP, 2], steps  # DDP runs the hook on the skipped step
        assert [step for step, _ in got["seen"]] == steps, f"rank {rank}: {[s for s, _ in got['seen']]}"
        for (step, mine), (_, theirs) in zip(got["seen"], ddp["seen"], strict=True):
            where = f"rank {rank}, {strategy}, step {step}"
            if step != POISONED_STEP:  # fp16 compute copies round where DDP's autocast does
                _assert_grads(mine, theirs, where, 2e-2)
                continue
            assert list(mine) == list(theirs), where
            for name, value in theirs.items():
                assert value is not None and mine[name] is not None, (where, name)
                assert not bool(torch.isfinite(value).all()), (where, name)  # the reference overflowed there
                assert not bool(torch.isfinite(mine[name]).all()), f"{where}: {name}.grad is finite"
                finite = torch.isfinite(value) & torch.isfinite(mine[name])
                assert_same_non_finite(mine[name][~finite], value[~finite], name, where)
        assert_state_close(got["weights"], ddp["weights"], rel=2e-2, what=f"rank {rank}, {strategy}")


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_read_inside_an_accumulation_window(runs: list[dict], strategy: str) -> None:
    """DDP's value (this rank's own sum) at every stage and world size: zero1 keeps the window's gradients anyway,
    zero2/zero3 hold them because the module overrides on_train_batch_end (keep_window_gradients=None; see [Note:
    p.grad as under DDP] in core/engine/ddp_gradients.py), one process reads its own sum from the slices."""
    for rank, result in enumerate(runs):
        ddp, got = result[("ddp", "window")], result[(strategy, "window")]
        assert "error" not in ddp and len(ddp["seen"]) == 6, ddp.get("error")  # 3 steps of 2 micro-batches
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert len(got["seen"]) == len(ddp["seen"])
        for index, (mine, theirs) in enumerate(zip(got["seen"], ddp["seen"], strict=True)):
            _assert_grads(mine, theirs, f"rank {rank}, {strategy}, batch {index}", 1e-5)
