"""ZeroPrecision: the precision plugin ZeroStrategy always runs with (fp32, bf16 or fp16 with loss scaling).

It owns the order of an optimizer step, which ZeRO changes: the closure (forward + backward) runs; the engine makes
the reduced gradient slices available; with fp16 they are unscaled and checked for inf/NaN on every rank (one
scalar all-reduce, so all ranks agree); Lightning's ``on_before_optimizer_step`` and clipping run on the slices
(clipping by norm sees the global norm), on a step that overflowed too, as under Lightning's DDP (its GradScaler
skips after them); an overflow then skips the step everywhere — no optimizer step, gradients dropped, the LR
scheduler held back — otherwise the optimizer steps the fp32 master slices and the engine propagates the new values
into the compute-dtype parameters. It contains no collectives: it calls the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.types import Steppable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.precision_settings import PrecisionSettings, engine_device_type, skip_step_on_overflow
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.precision_names import ALIASES, COMPUTE_DTYPES, normalize_precision  # noqa: F401 (re-exported)
from zero_strategy.lightning.gradient_hooks import overrides_gradient_hooks
from zero_strategy.lightning.schedule_hold import hold_back_lr_schedulers, release_lr_schedulers


class _AlreadyRun:
    """[Note: the closure the optimizer's step receives]
    Lightning's DDP path calls ``optimizer.step(closure=...)`` with every precision plugin but 16-mixed, whose
    GradScaler calls ``optimizer.step()`` without one (precision.py and amp.py in lightning/pytorch/plugins), in
    automatic and manual optimization alike; a wrapper or mock of ``step`` sees the same call under ZeRO. The
    closure (forward and backward) has run before the step window, whose reduction needs its gradients, so the
    closure handed to ``step`` returns that run's result without running anything again: torch's optimizers call it
    once, for the loss ``step`` returns, and get DDP's value. (LBFGS, which calls it repeatedly, is refused: see
    core/engine/optimizer.py.)"""

    def __init__(self, result: Any) -> None:
        self._result = result

    def __call__(self) -> Any:
        return self._result


class ZeroPrecision(Precision):
    """``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (dynamic loss scaling when ``loss_scale`` is 0).

    Mixed precision stores the compute-dtype parameters ZeRO gathers and runs forward under autocast; the fp32
    master slices are the source of truth. Normalization layers compute in fp32.
    """

    def __init__(
        self,
        precision: str | int = "32-true",
        *,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        reduce_dtype: str | None = None,
    ) -> None:
        # The knobs' meaning is shared with the Fabric adapter (zero_strategy/fabric/precision.py).
        self.settings = PrecisionSettings(
            precision,
            loss_scale=loss_scale,
            initial_scale_power=initial_scale_power,
            loss_scale_window=loss_scale_window,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_loss_scale=min_loss_scale,
            reduce_dtype=reduce_dtype,
        )
        self.precision = self.settings.precision  # type: ignore[assignment]
        self.compute_dtype = self.settings.compute_dtype
        self.reduce_dtype = self.settings.reduce_dtype
        self.scaler = self.settings.scaler
        self._engine: ZeroEngine | None = None
        self._device_type: str | None = None  # where the engine's module computes: the forward's autocast device
        self._skipped_last: dict[int, bool] = {}  # id(optimizer) -> its last step was skipped
        self._step_schedulers: set[int] = set()  # id() of the LR schedulers Lightning steps every step
        self._schedules_module: LightningModule | None = None  # where hold_back_lr_schedulers was installed

    # --------------------------------------------------------------------------------------- what it is
    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when not scaling)."""
        return self.scaler.scale if self.scaler else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler else 0

    def policy(self) -> MixedPrecisionPolicy | None:
        return self.settings.policy()

    def __getstate__(self) -> dict[str, Any]:
        """A copy holds no engine: see [Note: a copy of the strategy holds no engine] in sharded_model.py."""
        return {**vars(self), "_engine": None}

    def attach(self, engine: ZeroEngine | None) -> None:
        """Called by ZeroStrategy once the model is sharded (None after teardown)."""
        self._engine = engine
        # once per engine, not per forward: finding it lists every FlatParam of the module
        self._device_type = engine_device_type(engine)

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPrecision is used before ZeroStrategy sharded the model (setup() not run).")
        return self._engine

    # ----------------------------------------------------------------------------------- forward/backward
    @override
    def forward_context(self) -> Any:
        return self.settings.autocast(self._device_type)

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self.settings.scale(tensor), module)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        self._gather_for_gradient_hooks(module)  # on_after_backward
        return super().post_backward(tensor, module)

    def _gather_for_gradient_hooks(self, module: LightningModule) -> None:
        """Before Lightning's gradient hooks, when the module or a callback overrides one: the gradients reads of
        ``p.grad`` return are gathered here, where every rank passes, so that a read made on one rank only
        (``rank_zero_only``) needs no exchange (see [Note: p.grad as under DDP] in core/engine/ddp_gradients.py).
        Nobody else pays for it."""
        if self._engine is not None and overrides_gradient_hooks(module):
            self._engine.gather_gradients_for_reads()

    # -------------------------------------------------------------------------------------- the step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: LightningModule | nn.Module,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        assert isinstance(optimizer, Optimizer)
        closure_result = closure()
        with self.engine.step_window(optimizer) as window:
            overflow = self.scaler is not None and self._skip_on_overflow(optimizer, model)
            if isinstance(model, LightningModule):
                # a step the loss scale skips runs the hooks too, as Lightning's DDP does (its GradScaler skips
                # after them): they read the non-finite unscaled gradients
                self._gather_for_gradient_hooks(model)  # on_before_optimizer_step, configure_gradient_clipping
                self._after_closure(model, optimizer)
            if overflow:
                window.skip()  # the window drops the gradients on every rank: nothing moves
                return closure_result
            if self.precision != "16-mixed":  # see [Note: the closure the optimizer's step receives]
                kwargs = {"closure": _AlreadyRun(closure_result), **kwargs}
            result = self.engine.step(optimizer, **kwargs)
        self._skipped_last[id(optimizer)] = False
        return closure_result if result is None else result

    def _skip_on_overflow(self, optimizer: Optimizer, model: LightningModule | nn.Module) -> bool:
        """Unscale; on an overflow anywhere, drop this step on every rank and move the scale. True if skipped."""
        assert self.scaler is not None
        step = model.trainer.global_step if isinstance(model, LightningModule) else self.scaler.iteration
        overflow = skip_step_on_overflow(self.engine, self.scaler, optimizer, step)
        if overflow:
            self._skipped_last[id(optimizer)] = True
        self._log_scaler(model)
        return overflow

    def _log_scaler(self, model: LightningModule | nn.Module) -> None:
        if not isinstance(model, LightningModule) or model._trainer is None:
            return
        trainer = model.trainer
        every = max(1, getattr(trainer, "log_every_n_steps", 1))
        if trainer.is_global_zero and trainer.loggers and trainer.global_step % every == 0:
            metrics = {"loss_scale": self.loss_scale, "skipped_steps": float(self.skipped_steps)}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        """Hold back step-interval LR schedulers after a skipped fp16 step (torch AMP lets them advance): see
        [Note: holding the LR schedule back]."""
        self._step_schedulers = {
            id(getattr(config, "scheduler", config))
            for config in lr_schedulers
            if getattr(config, "interval", None) == "step"
        }
        lightning_module = next((m for m in model.modules() if isinstance(m, LightningModule)), None)
        if self.scaler is not None and lightning_module is not None:
            hold_back_lr_schedulers(lightning_module, self._holds_back)
            self._schedules_module = lightning_module
        return model, optimizers, lr_schedulers

    def _holds_back(self, scheduler: Any) -> bool:
        """Whether Lightning's step of ``scheduler`` now must do nothing: its optimizer's last step was skipped."""
        optimizer = getattr(scheduler, "optimizer", None)
        return id(scheduler) in self._step_schedulers and self._skipped_last.get(id(optimizer), False)

    @override
    def teardown(self) -> None:
        module, self._schedules_module = self._schedules_module, None
        if module is not None:
            release_lr_schedulers(module)
        super().teardown()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._unscale_before_clipping(optimizer)
        self.engine.clip_grad_norm_(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._unscale_before_clipping(optimizer)
        self.engine.clip_grad_value_(optimizer, float(clip_val))

    def _unscale_before_clipping(self, optimizer: Optimizer) -> None:
        """fp16: clipping sees unscaled gradients. Under automatic optimization ``optimizer_step`` has unscaled
        already; under manual optimization the user clips between ``manual_backward`` and ``opt.step()``, so it
        happens here and the step finds it done (the engine unscales once per step, after reducing whatever
        stage 1 still held on the module; the clipping calls reduce that for fp32 too)."""
        if self.scaler is not None:
            self.engine.unscale_and_check_overflow(optimizer, 1.0 / self.scaler.scale)

    # ----------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
