"""``p.grad`` inside an accumulation window under the Trainer at zero2/zero3 on 2 processes, where DDP's holds each
rank's own sum: ``keep_window_gradients=True`` gives DDP's values in ``training_step`` (zero1 too, without the
option; at a window's first micro-batch DDP's is the previous step's average); the default (auto) gives them
in the module's and a user callback's ``on_train_batch_end``; ``False`` makes a read raise ``GradientReadError``
naming the option. Lightning's DDP runs in the same launch; stage 3 on one host's shared memory and on
``collectives="point_to_point"``. A module that reads nothing, with a Lightning callback overriding
``on_train_batch_end``, keeps ZeRO's traffic (a reduction per micro-batch); the hold decision itself (who pays
DDP's memory) is tested in one process too.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.compare import assert_state_close
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.models import TiedLM, lm_loss
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from examples.run_summary import MeasureRun
from zero_strategy import ZeroStrategy
from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.lightning.gradient_hooks import holds_window_gradients, overrides_gradient_hooks
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero2": lambda **options: ZeroStrategy(stage=2, **options),
    "zero3": lambda **options: ZeroStrategy(stage=3, collectives="auto", **options),
    "zero3_point_to_point": lambda **options: ZeroStrategy(stage=3, collectives="point_to_point", **options),
}
BATCHES = 4  # accumulation over 2: two windows, so a read also sees the previous window's average


def _grads(module: torch.nn.Module) -> dict[str, Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().float().clone() for name, p in module.named_parameters()}


class Records(pl.LightningModule):
    """Reads nothing; its subclasses read ``p.grad`` in one hook each and record what they saw."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.seen: dict[str, list[dict[str, Tensor | None]]] = {"training_step": [], "batch_end": [], "callback": []}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return lm_loss(self.net, batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self) -> None:
        report = getattr(self.trainer.strategy, "communication_report", None)
        self.reduce_scattered = report()["reduce_scatter"] if report is not None else None


class ReadsInTrainingStep(Records):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        # a window's second micro-batch: what its first backward left (DDP: this rank's own sum); its first: the
        # previous step's average (Lightning zeroes the gradients after training_step), None before the first step
        self.seen["training_step"].append(_grads(self))
        return super().training_step(batch, batch_idx)


class ReadsAfterBatch(Records):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen["batch_end"].append(_grads(self))


class ReadsEverywhere(ReadsInTrainingStep, ReadsAfterBatch):
    """DDP's reference: every read of the ZeRO runs, in one fit (reads change nothing of DDP's training)."""


class ReadsAfterBackward(Records):
    def on_after_backward(self) -> None:
        self.seen["batch_end"].append(_grads(self))


class LogsGradients(pl.Callback):
    """A user's logging callback reading every rank's ``p.grad`` after each batch."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.seen["callback"].append(_grads(pl_module))  # type: ignore[operator]


class LogsAfterBackward(pl.Callback):
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass


class MyCheckpoint(ModelCheckpoint):
    """A user's subclass of a Lightning callback that inherits its ``on_train_batch_end``."""


def _fit(module: Records, strategy: Any, world: int, callbacks: list[pl.Callback]) -> dict[str, Any]:
    bar = any(isinstance(callback, TQDMProgressBar) for callback in callbacks)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=bar, enable_model_summary=False,
                         limit_train_batches=BATCHES, accumulate_grad_batches=2, callbacks=callbacks)
    trainer.fit(module, loader(4 * BATCHES * world, 21))
    return {"seen": module.seen, "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "reduce_scattered": module.reduce_scattered}


def fit_each(rank: int, world: int) -> dict:
    as_launched_rank(rank, world)
    pl.seed_everything(0, verbose=False)
    out: dict = {"ddp": _fit(ReadsEverywhere(), "ddp", world, [LogsGradients()])}
    pl.seed_everything(0, verbose=False)  # stage 1 keeps a window's gradients anyway: reads need no option
    out[("zero1", "keep")] = _fit(ReadsInTrainingStep(), ZeroStrategy(stage=1), world, [])
    for name, make in STRATEGIES.items():
        pl.seed_everything(0, verbose=False)
        out[(name, "keep")] = _fit(ReadsInTrainingStep(), make(keep_window_gradients=True), world, [])
        pl.seed_everything(0, verbose=False)
        out[(name, "auto")] = _fit(ReadsAfterBatch(), make(), world, [LogsGradients()])
        pl.seed_everything(0, verbose=False)  # reads nothing, with a Lightning callback overriding the hook
        out[(name, "quiet")] = _fit(Records(), make(), world, [TQDMProgressBar()])
        pl.seed_everything(0, verbose=False)
        try:
            _fit(ReadsAfterBackward(), make(keep_window_gradients=False), world, [])
            out[(name, "never")] = "no error"
        except Exception as error:  # every rank reads at the same point: each raises, and each reports it
            out[(name, "never")] = f"{type(error).__name__}: {error}"
    return out


def _assert_records(got: list[dict], want: list[dict], where: str) -> None:
    assert len(got) == len(want), f"{where}: {len(got)} reads, DDP {len(want)}"
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert list(mine) == list(theirs), where
        absent = [name for name, value in theirs.items() if value is None]
        assert [name for name, value in mine.items() if value is None] == absent, f"{where}, read {index}"
        assert_state_close({k: v for k, v in mine.items() if v is not None},
                           {k: v for k, v in theirs.items() if v is not None}, rel=1e-5, what=f"{where}, read {index}")


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(fit_each, 2, timeout_s=500)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_reads_inside_a_window_give_ddp_values(runs: list[dict], strategy: str) -> None:
    for rank, result in enumerate(runs):
        ddp = result["ddp"]["seen"]
        # what the comparison needs was recorded: this rank's own sum (which differs between the ranks) inside
        # each window, and after every batch (inside the window and after its step)
        assert len(ddp["training_step"]) == BATCHES
        assert all(v is None for v in ddp["training_step"][0].values())  # before the first backward
        assert all(v is not None for record in ddp["training_step"][1:] for v in record.values())
        assert len(ddp["batch_end"]) == len(ddp["callback"]) == BATCHES
        keep, auto = result[(strategy, "keep")], result[(strategy, "auto")]
        _assert_records(keep["seen"]["training_step"], ddp["training_step"], f"rank {rank}, {strategy}, True")
        _assert_records(auto["seen"]["batch_end"], ddp["batch_end"], f"rank {rank}, {strategy}, auto, module")
        _assert_records(auto["seen"]["callback"], ddp["callback"], f"rank {rank}, {strategy}, auto, callback")
        for which, run in (("True", keep), ("auto", auto)):
            assert_state_close(run["weights"], result["ddp"]["weights"], rel=1e-5,
                               what=f"rank {rank}, {strategy}, {which}, final weights")
    own = [result["ddp"]["seen"]["training_step"][1]["net.emb.weight"] for result in runs]
    assert not torch.allclose(own[0], own[1]), "the ranks' own sums are equal: the test cannot tell them from DDP's"


@pytest.mark.timeout(1000)
def test_reads_in_training_step_at_stage_1_give_ddp_values(runs: list[dict]) -> None:
    """Before the model computes in training_step: the previous step's average, and inside a window this rank's
    own sum (see [Note: reads until the model computes] in core/engine/first_use.py)."""
    for rank, result in enumerate(runs):
        _assert_records(result[("zero1", "keep")]["seen"]["training_step"], result["ddp"]["seen"]["training_step"],
                        f"rank {rank}, zero1")
        assert_state_close(result[("zero1", "keep")]["weights"], result["ddp"]["weights"], rel=1e-5,
                           what=f"rank {rank}, zero1, final weights")


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_module_that_reads_nothing_keeps_zeros_traffic(runs: list[dict], strategy: str) -> None:
    """Reduce-scattered bytes: one reduction per micro-batch where nothing reads (ZeRO's memory: the window's
    gradients are not held), one per window where the window is held (DDP's memory, half the traffic here)."""
    psi = sum(p.numel() for p in TiedLM(n_blocks=2).parameters())
    for rank, result in enumerate(runs):
        quiet, keep = result[(strategy, "quiet")], result[(strategy, "keep")]
        assert_state_close(quiet["weights"], result["ddp"]["weights"], rel=1e-5, what=f"rank {rank}, {strategy}")
        expected = BATCHES * 4 * psi  # fp32, every micro-batch; padding adds a few elements per unit
        assert expected <= quiet["reduce_scattered"] <= expected * 1.05, (rank, quiet["reduce_scattered"], expected)
        assert quiet["reduce_scattered"] == 2 * keep["reduce_scattered"], (rank, quiet, keep)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_never_keeping_makes_a_read_inside_a_window_an_error_naming_the_option(runs: list[dict],
                                                                               strategy: str) -> None:
    for rank, result in enumerate(runs):
        error = result[(strategy, "never")]
        assert error.startswith("GradientReadError") and "keep_window_gradients=True" in error, (rank, error)
        assert "strategy.keep_window_gradients=true" in error, (rank, error)


def _decides(module: Records, callbacks: list[pl.Callback], keep: bool | None = None) -> bool:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
                         enable_progress_bar=True, enable_checkpointing=True, enable_model_summary=True)
    module.trainer = trainer
    return holds_window_gradients(module, keep)


@pytest.mark.timeout(60)
def test_who_holds_a_windows_gradients() -> None:
    """Auto holds where user code runs after a window's backward (on_after_backward; on_train_batch_end outside
    Lightning's and this package's callbacks); a module that reads nothing, with Lightning's own callbacks (which
    override on_train_batch_end), keeps ZeRO's memory and reduce-scatter per micro-batch. The option overrides."""
    builtin = [TQDMProgressBar(), ModelCheckpoint()]
    assert all(is_overridden("on_train_batch_end", callback, pl.Callback) for callback in builtin)
    assert not _decides(Records(), builtin)
    assert not _decides(Records(), [MyCheckpoint()])  # inherits Lightning's hook: known not to read
    assert not _decides(Records(), [MeasureRun(".")])  # the example's own timing callback measures ZeRO's memory
    assert _decides(Records(), builtin, keep=True) and not _decides(ReadsAfterBatch(), builtin, keep=False)
    assert _decides(ReadsAfterBatch(), builtin)
    assert _decides(Records(), [*builtin, LogsGradients()])
    assert _decides(ReadsAfterBackward(), builtin) and _decides(Records(), [LogsAfterBackward()])
    assert not _decides(ReadsAfterBackward(), [], keep=False)
    # holding is not gathering: a module reading only after the batch costs no gather before the gradient hooks
    module = ReadsAfterBatch()
    module.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    assert not overrides_gradient_hooks(module)


def test_the_option_is_validated_and_reaches_the_strategy() -> None:
    assert ZeroStrategy(stage=2, keep_window_gradients=True).config.keep_window_gradients is True
    assert ZeroConfig().keep_window_gradients is None
    for bad in ("yes", 1):
        with pytest.raises(ZeroConfigError, match="keep_window_gradients="):
            ZeroConfig(keep_window_gradients=bad)  # type: ignore[arg-type]
