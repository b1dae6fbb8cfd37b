"""Whether a LightningModule's code reads gradients in Lightning's hooks: the module's own overrides, and its
callbacks'. Decides where the Trainer pays for DDP's reads of ``p.grad`` (see [Note: p.grad as under DDP] in
core/engine/ddp_gradients.py): the gradients are gathered before the gradient hooks run, and an accumulation window
at stages 2/3 keeps its gradients on the module (DDP's memory) when code that runs after a window's backward may
read them: ``on_after_backward``, or ``on_train_batch_end`` where logging code reads gradients (the hooks that run
at the window's end need no hold: a stage-3 model too large for its full gradients keeps logging norms in
``on_before_optimizer_step`` at ZeRO's memory). ``ZeroConfig.keep_window_gradients`` overrides that guess.
The answers are the same on every rank (the same classes and callbacks run everywhere), so what they decide is a
collective every rank makes alike."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
# Callbacks of these packages are known not to read gradients in on_train_batch_end (progress bars, ModelCheckpoint,
# this package's profiler and preemption saver): they must not cost every run with accumulation DDP's memory.
_NON_READING_PACKAGES = ("lightning", "zero_strategy")

# (the module's class, its callbacks' classes) -> (reads mid-window, overrides a gradient hook). Overriding is a
# property of the classes, and asking Lightning's ``is_overridden`` about every hook and callback twice per step
# cost 0.1 ms of a 5 M model's step (benchmarks/bench_phases.py): each pair of classes is asked once per process.
_ANSWERS: dict[tuple[type, tuple[type, ...]], tuple[bool, bool]] = {}


def _user_batch_end(callback: Callback) -> bool:
    """Whether ``callback``'s ``on_train_batch_end`` is an override written outside the packages known not to read
    gradients there (where the method is defined decides: a user's subclass of ModelCheckpoint inherits its hook)."""
    if not is_overridden("on_train_batch_end", callback, Callback):
        return False
    defined_in = getattr(type(callback).on_train_batch_end, "__module__", None) or type(callback).__module__
    return defined_in.split(".")[0] not in _NON_READING_PACKAGES


def _answers(module: LightningModule) -> tuple[bool, bool]:
    trainer = module._trainer
    callbacks = list(trainer.callbacks) if trainer is not None else []  # type: ignore[attr-defined]
    key = (type(module), tuple(type(callback) for callback in callbacks))
    if key not in _ANSWERS:
        after_backward = is_overridden("on_after_backward", module) or any(
            is_overridden("on_after_backward", callback, Callback) for callback in callbacks)
        mid_window = after_backward or is_overridden("on_train_batch_end", module) or any(
            _user_batch_end(callback) for callback in callbacks)
        any_hook = after_backward or any(
            is_overridden(hook, module) for hook in (*_GRADIENT_HOOKS, "configure_gradient_clipping")
        ) or any(is_overridden(hook, callback, Callback) for callback in callbacks for hook in _GRADIENT_HOOKS)
        _ANSWERS[key] = (mid_window, any_hook)
    return _ANSWERS[key]


def holds_window_gradients(module: LightningModule, keep: bool | None) -> bool:
    """Whether an accumulation window's micro-batches before its last keep their gradients on the module, where
    DDP's ``p.grad`` is each rank's own sum. ``keep``: ``ZeroConfig.keep_window_gradients`` (None: auto, held when
    user code runs in ``on_after_backward`` or, outside Lightning's and this package's callbacks,
    ``on_train_batch_end``)."""
    return keep if keep is not None else _answers(module)[0]


def overrides_gradient_hooks(module: LightningModule) -> bool:
    """Whether user code runs in a gradient hook (``on_after_backward``, ``on_before_optimizer_step``,
    ``configure_gradient_clipping``), where it could read ``p.grad`` on one rank only: the gradients are gathered
    before it runs."""
    return _answers(module)[1]
