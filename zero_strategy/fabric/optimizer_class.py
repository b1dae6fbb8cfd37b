"""``zero_grad`` through Fabric's optimizer wrapper.

[Note: zero_grad through Fabric's wrapper]
Fabric hands the user a ``_FabricOptimizer`` whose class derives from the optimizer's class and which forwards
other attributes to the optimizer. ``wrapper.zero_grad()`` therefore finds the class's method first and never
reaches the optimizer's instance attribute through which the engine learns that the gradients were cleared (see
[Note: zero_grad reaches the module's gradients] in core/engine/optimizer.py): the engine would keep them and their
loss-scale state past the clear. Fabric gives the strategy no hold on the wrapper (it is made after the strategy
returns the optimizer), so the optimizer gets, while its module is set up, a subclass of its own class (same name
and module, ``isinstance`` holds) whose ``zero_grad`` calls the optimizer's own; Fabric derives the wrapper's class
from it. Teardown gives the optimizer its class back. ``type(optimizer)`` is that subclass in between, and such an
optimizer object does not pickle (its state_dict does, as Fabric saves it).
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from zero_strategy.core.engine.optimizer import FORWARDS_ZERO_GRAD as _FORWARDS
from zero_strategy.core.engine.optimizer import class_zero_grad

_SUBCLASSES: dict[type, type] = {}  # one per optimizer class, made once


def _forward_zero_grad(self: Any, set_to_none: bool = True) -> None:
    """The subclass's ``zero_grad``: the optimizer's own (the engine's instance attribute, once bound)."""
    target = vars(self).get("_optimizer", self)  # Fabric's wrapper keeps the optimizer there
    own = vars(target).get("zero_grad")
    if own is not None:
        own(set_to_none=set_to_none)
    else:  # not bound (anymore): the user's class's method
        class_zero_grad(target, set_to_none)


def forward_zero_grad(optimizer: Optimizer) -> None:
    """Give ``optimizer`` the subclass of its class whose ``zero_grad`` reaches the engine (see the Note)."""
    klass = type(optimizer)
    if vars(klass).get(_FORWARDS, False):
        return
    if klass not in _SUBCLASSES:
        namespace = {"zero_grad": _forward_zero_grad, _FORWARDS: True, "__module__": klass.__module__,
                     "__qualname__": klass.__qualname__}  # fmt: skip
        _SUBCLASSES[klass] = type(klass.__name__, (klass,), namespace)
    optimizer.__class__ = _SUBCLASSES[klass]


def restore_class(optimizer: Optimizer) -> None:
    """Undo :func:`forward_zero_grad`. Idempotent."""
    klass = type(optimizer)
    if vars(klass).get(_FORWARDS, False):
        optimizer.__class__ = klass.__bases__[0]
