"""Holding a step-interval LR scheduler back after a skipped fp16 step, without touching the scheduler.

[Note: holding the LR schedule back]
A skipped step (fp16 overflow) must not advance a step-interval scheduler, or the learning rate moves while the
weights do not. Neither the scheduler nor its class may change: ``type(scheduler)``, isinstance checks, pickle
and deepcopy must see what the user built, and ``LRScheduler.state_dict()`` is its ``__dict__`` minus the
optimizer, so an attribute stored on the scheduler would land in every checkpoint. The interception is therefore
where Lightning steps schedulers: it calls the LightningModule's public ``lr_scheduler_step(scheduler, metric)``
hook (``getattr(module, "lr_scheduler_step")``), after every optimizer step of automatic optimization. The
module gets an *instance* attribute of that name that does nothing when the plugin says the scheduler's optimizer
skipped its last step, and otherwise calls the class's hook, the user's override included. It is a ``partial``
of a module-level function, so a module pickled or deep-copied during the fit stays picklable and its copy
simply calls the class's hook (the decision is looked up per module, weakly). Teardown removes it.
Manual optimization steps its schedulers itself (Lightning does not call the hook), so nothing changes there.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from lightning.pytorch import LightningModule

_HOLDS_BACK: weakref.WeakKeyDictionary[LightningModule, Callable[[Any], bool]] = weakref.WeakKeyDictionary()


def _lr_scheduler_step_unless_skipped(module: LightningModule, scheduler: Any, metric: Any = None) -> None:
    holds_back = _HOLDS_BACK.get(module)
    if holds_back is not None and holds_back(scheduler):
        return  # its optimizer did not step: neither does the schedule
    type(module).lr_scheduler_step(module, scheduler, metric)


def _installed(module: LightningModule) -> bool:
    attribute = vars(module).get("lr_scheduler_step")
    return isinstance(attribute, partial) and attribute.func is _lr_scheduler_step_unless_skipped


def hold_back_lr_schedulers(module: LightningModule, holds_back: Callable[[Any], bool]) -> None:
    """Make Lightning's ``lr_scheduler_step`` calls on ``module`` do nothing while ``holds_back(scheduler)`` is
    true. Idempotent (a second call replaces the predicate)."""
    if "lr_scheduler_step" in vars(module) and not _installed(module):
        raise ValueError(
            f"{type(module).__name__} has an instance attribute 'lr_scheduler_step'; ZeroPrecision needs that hook "
            "to hold the LR schedule back after skipped fp16 steps. Override the method in the class instead."
        )
    _HOLDS_BACK[module] = holds_back
    step = partial(_lr_scheduler_step_unless_skipped, module)
    # Lightning's is_overridden() follows __wrapped__: it must keep seeing the class's hook, not ours.
    step.__wrapped__ = type(module).lr_scheduler_step  # type: ignore[attr-defined]
    vars(module)["lr_scheduler_step"] = step


def release_lr_schedulers(module: LightningModule) -> None:
    """Undo :func:`hold_back_lr_schedulers`. Idempotent."""
    _HOLDS_BACK.pop(module, None)
    if _installed(module):
        del vars(module)["lr_scheduler_step"]
