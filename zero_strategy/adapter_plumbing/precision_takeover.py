"""Taking over the precision choice of one Lightning connector (the Trainer's ``_AcceleratorConnector`` or Fabric's
``_Connector``) for one call: the mechanism behind [Note: taking over the precision choice of one Trainer] in
lightning/precision_selection.py and [Note: taking over the precision choice of one Fabric] in
fabric/precision_selection.py, which each say when and why their strategy uses it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

CHOOSER = "_check_and_init_precision"  # the connectors' method that turns the precision flag into a plugin
Connector = TypeVar("Connector")


def connector_on_stack(kind: type[Connector]) -> Connector | None:
    """The innermost connector of class ``kind`` whose method is on the call stack, if any."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, kind):
            return owner
        frame = frame.f_back
    return None


def take_over_once(connector: Any, strategy: object, choose: Callable[[], Any]) -> None:
    """Make ``connector``'s next precision choice ``choose()`` if ``strategy`` is still the one it resolved, for
    that one call (its own method again afterwards). Idempotent."""
    if CHOOSER in vars(connector):
        return

    def check_and_init_precision() -> Any:
        delattr(connector, CHOOSER)  # one call: from now on the connector is Lightning's own again
        if connector.strategy is not strategy:  # another strategy was resolved after all: Lightning decides
            return getattr(connector, CHOOSER)()
        return choose()

    setattr(connector, CHOOSER, check_and_init_precision)
