"""Which precision plugin a ZeroStrategy runs with: always ZeroPrecision, built from the Trainer's own flag.

[Note: taking over the precision choice of one Trainer]
Lightning's ``_AcceleratorConnector._check_and_init_precision`` turns ``Trainer(precision=...)`` into a plugin. It
special-cases only its own sharded strategies (XLA, DeepSpeed, FSDP); for any other strategy "16-mixed" and
"bf16-mixed" become torch AMP, and on a CPU "16-mixed" is first rewritten to "bf16-mixed" with a warning. The
strategy only ever receives the result (its ``precision_plugin`` setter), by which time the user's flag is gone:
fp16 could not compute in fp16 on a CPU, and a precision we do not run would not fail with our message.

Lightning has no hook for this, and ``import zero_strategy`` must not patch Lightning's classes (every other
Trainer in the process keeps Lightning's behaviour). So a ZeroStrategy takes over that one decision of the one
connector that is resolving it: it sets ``_check_and_init_precision`` on that connector *instance*, which Lightning's
own call ``self._check_and_init_precision()`` finds before the class's method, and which removes itself after its
one call. The connector is found on the call stack at the two moments Lightning runs a ZeroStrategy's code while
resolving the strategy, both before it chooses the precision:

- ``Trainer(strategy="zero3")``: the registry constructs the strategy inside the connector (``ZeroStrategy.__init__``
  calls :meth:`ZeroPrecisionChoice.take_over_precision_choice`);
- ``Trainer(strategy=ZeroStrategy(...))``: the connector reads the instance's ``_precision_plugin`` (a property of
  :class:`ZeroPrecisionChoice` for this reason).

tests/lightning/test_precision_selection.py holds both paths, and checks in a fresh interpreter that importing the
package leaves Lightning's classes and the warning filters as they were.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from zero_strategy.adapter_plumbing.precision_takeover import connector_on_stack, take_over_once
from zero_strategy.core.plan.precision_names import normalize_precision
from zero_strategy.lightning.precision import ZeroPrecision


def to_zero_precision(plugin: Precision) -> ZeroPrecision:
    """Translate a Lightning precision plugin (Precision, MixedPrecision, HalfPrecision) into ZeroPrecision,
    refusing what we cannot honour with ZeroPrecision's error."""
    if isinstance(plugin, ZeroPrecision):
        return plugin
    return ZeroPrecision(str(getattr(plugin, "precision", "32-true")))


def choose_zero_precision(connector: _AcceleratorConnector, own: ZeroPrecision | None) -> ZeroPrecision:
    """The plugin a ZeroStrategy runs with: ``own`` (given to the strategy itself, e.g. from a DeepSpeed config),
    which the Trainer's ``precision=`` must not contradict; else a ``plugins=[...]`` precision plugin, translated;
    else ZeroPrecision of the Trainer's flag as the user wrote it."""
    flag = str(connector._precision_flag)  # Lightning's unified spelling; "32-true" when the user gave none
    if own is not None:
        # An explicit "32-true" cannot be told from the default, so only another precision is a contradiction.
        if normalize_precision(flag) not in ("32-true", own.precision):
            raise ValueError(
                f"precision requested twice: Trainer(precision={flag!r}) and the strategy's "
                f"ZeroPrecision({own.precision!r}); set it in one place."
            )
        return own
    given = connector._precision_plugin_flag  # from Trainer(plugins=[...])
    if isinstance(given, Precision):
        return to_zero_precision(given)
    return ZeroPrecision(flag)


def take_over_precision_choice(strategy: object, own_precision: Callable[[], ZeroPrecision | None]) -> None:
    """If a Lightning accelerator connector is resolving ``strategy`` right now, make its precision choice ours, for
    that one connector and that one call (see [Note: taking over the precision choice of one Trainer]; the mechanism
    is shared with the Fabric adapter). ``own_precision`` reads the plugin given to the strategy itself when the
    choice is made. Idempotent; without a connector on the call stack (a strategy built outside a Trainer) it does
    nothing."""
    connector = connector_on_stack(_AcceleratorConnector)
    if connector is None:
        return

    def choose() -> Precision:
        connector._validate_precision_choice()  # Lightning's own checks of the flags, as its method runs them
        return choose_zero_precision(connector, own_precision())

    take_over_once(connector, strategy, choose)


class ZeroPrecisionChoice:
    """The precision side of ZeroStrategy (a base class before Lightning's): the ZeroPrecision it runs with, given to
    it or chosen for it by its Trainer, and the take-over of that Trainer's choice."""

    _given_precision: ZeroPrecision | None = None  # behind _precision_plugin; Strategy.__init__ sets it first
    _default_precision: ZeroPrecision | None = None  # returned before any is given or chosen; never counts as given

    def take_over_precision_choice(self) -> None:
        """Called by ``__init__``: built by the strategy registry inside a Trainer, take over its precision choice
        (see [Note: taking over the precision choice of one Trainer])."""
        take_over_precision_choice(self, lambda: self._given_precision)

    @property
    def precision_plugin(self) -> ZeroPrecision:
        if self._given_precision is not None:
            return self._given_precision
        if self._default_precision is None:  # fp32 until a Trainer chooses
            self._default_precision = ZeroPrecision()
        return self._default_precision

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = plugin

    @property
    def _precision_plugin(self) -> ZeroPrecision | None:
        """The plugin given to this strategy or chosen for it by its Trainer (None: neither yet). Lightning's
        connector reads it of a strategy instance before it turns ``precision=`` into a plugin: the moment to take
        that choice over (see [Note: taking over the precision choice of one Trainer])."""
        take_over_precision_choice(self, lambda: self._given_precision)
        return self._given_precision

    @_precision_plugin.setter
    def _precision_plugin(self, plugin: Precision | None) -> None:
        # A plugin Lightning or a user built (torch AMP, HalfPrecision, Precision) is translated into ours.
        self._given_precision = None if plugin is None else to_zero_precision(plugin)
