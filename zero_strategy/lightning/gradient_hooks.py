"""Whether a LightningModule's code reads gradients in Lightning's gradient hooks: the module's own overrides, and
its callbacks'. Decides where the Trainer pays for DDP's reads of ``p.grad`` (see [Note: p.grad as under DDP] in
core/engine/ddp_gradients.py): the gradients are gathered before those hooks run, and, when ``on_after_backward``
reads them, kept on the module during an accumulation window at stages 2/3 (the hooks that run at the window's
end need no hold: a stage-3 model too large for its full gradients keeps logging norms there at ZeRO's memory).
The answers are the same on every rank (the same classes and callbacks run everywhere), so what they decide is a
collective every rank makes alike."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")

# (the module's class, its callbacks' classes) -> (reads mid-window, overrides a gradient hook). Overriding is a
# property of the classes, and asking Lightning's ``is_overridden`` about every hook and callback twice per step
# cost 0.1 ms of a 5 M model's step (benchmarks/bench_phases.py): each pair of classes is asked once per process.
_ANSWERS: dict[tuple[type, tuple[type, ...]], tuple[bool, bool]] = {}


def _answers(module: LightningModule) -> tuple[bool, bool]:
    trainer = module._trainer
    callbacks = list(trainer.callbacks) if trainer is not None else []  # type: ignore[attr-defined]
    key = (type(module), tuple(type(callback) for callback in callbacks))
    if key not in _ANSWERS:
        mid_window = is_overridden("on_after_backward", module) or any(
            is_overridden("on_after_backward", callback, Callback) for callback in callbacks)
        any_hook = mid_window or any(
            is_overridden(hook, module) for hook in (*_GRADIENT_HOOKS, "configure_gradient_clipping")
        ) or any(is_overridden(hook, callback, Callback) for callback in callbacks for hook in _GRADIENT_HOOKS)
        _ANSWERS[key] = (mid_window, any_hook)
    return _ANSWERS[key]


def reads_gradients_mid_window(module: LightningModule) -> bool:
    """Whether user code runs in ``on_after_backward``, the one gradient hook that runs at an accumulation window's
    micro-batches before its last, where DDP's ``p.grad`` is each rank's own sum."""
    return _answers(module)[0]


def overrides_gradient_hooks(module: LightningModule) -> bool:
    """Whether user code runs in a hook where it could read ``p.grad``."""
    return _answers(module)[1]
