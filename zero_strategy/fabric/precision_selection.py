"""Which precision plugin a ZeroFabricStrategy runs with: always ZeroFabricPrecision, built from Fabric's own flag.

[Note: taking over the precision choice of one Fabric]
Fabric's ``_Connector._check_and_init_precision`` turns ``Fabric(precision=...)`` into a plugin, special-casing only
its own sharded strategies: for any other strategy "16-mixed" and "bf16-mixed" become torch AMP, and on a CPU
"16-mixed" is first rewritten to "bf16-mixed" with a warning; the strategy only receives the result. The Trainer's
connector does the same, and the remedy is the same (see [Note: taking over the precision choice of one Trainer]
in lightning/precision_selection.py; both import the mechanism from adapter_plumbing/precision_takeover.py): a
strategy takes over that one decision of the one connector resolving it, by setting ``_check_and_init_precision``
on that connector *instance* for one call. The connector is found on the call stack at the two moments it runs
our code before choosing:

- ``Fabric(strategy="zero3")``: the registry constructs the strategy inside the connector;
- ``Fabric(strategy=ZeroFabricStrategy(...))``: the connector reads the instance's ``_precision``.

``import zero_strategy`` patches nothing: every other Fabric keeps Lightning's choice.
"""

from __future__ import annotations

from lightning.fabric.connector import _Connector
from lightning.fabric.plugins.precision import Precision

from zero_strategy.adapter_plumbing.precision_takeover import CHOOSER, connector_on_stack, take_over_once
from zero_strategy.core.plan.precision_names import normalize_precision
from zero_strategy.fabric.precision import ZeroFabricPrecision, to_zero_fabric_precision

# CHOOSER, connector_on_stack and take_over_once live in adapter_plumbing/precision_takeover.py now; re-exported for
# the old import path
__all__ = ["CHOOSER", "ZeroFabricPrecisionChoice", "choose_zero_fabric_precision", "connector_on_stack",
           "take_over_once"]


def choose_zero_fabric_precision(connector: _Connector, own: ZeroFabricPrecision | None) -> ZeroFabricPrecision:
    """``own`` (given to the strategy), which ``Fabric(precision=...)`` must not contradict; else a plugin given in
    ``plugins=[...]``, translated; else ZeroFabricPrecision of the flag as the user wrote it."""
    flag = str(connector._precision_input)  # "32-true" when the user gave none
    given = connector._precision_instance  # plugins=[...], or the strategy's own (read through _precision)
    if own is not None:
        # An explicit "32-true" cannot be told from the default, so only another precision is a contradiction.
        if normalize_precision(flag) not in ("32-true", own.precision):
            raise ValueError(
                f"precision requested twice: Fabric(precision={flag!r}) and the strategy's "
                f"ZeroFabricPrecision({own.precision!r}); set it in one place."
            )
        return own
    if isinstance(given, Precision):
        return to_zero_fabric_precision(given)
    return ZeroFabricPrecision(flag)


class ZeroFabricPrecisionChoice:
    """The precision side of ZeroFabricStrategy (a base class before Lightning's): the ZeroFabricPrecision it runs
    with, given to it or chosen for it by its Fabric (see [Note: taking over the precision choice of one Fabric])."""

    _given_precision: ZeroFabricPrecision | None = None
    _default_precision: ZeroFabricPrecision | None = None  # returned before any is chosen; never counts as given

    def take_over_precision_choice(self) -> None:
        connector = connector_on_stack(_Connector)
        if connector is not None:
            take_over_once(connector, self, lambda: choose_zero_fabric_precision(connector, self._given_precision))

    @property
    def precision(self) -> ZeroFabricPrecision:
        if self._given_precision is not None:
            return self._given_precision
        if self._default_precision is None:  # fp32 until a Fabric chooses
            self._default_precision = ZeroFabricPrecision()
        return self._default_precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._given_precision = None if plugin is None else to_zero_fabric_precision(plugin)

    @property
    def _precision(self) -> ZeroFabricPrecision | None:
        """Fabric's connector reads it of a strategy instance before it chooses the precision: the moment to take
        that choice over."""
        self.take_over_precision_choice()
        return self._given_precision

    @_precision.setter
    def _precision(self, plugin: Precision | None) -> None:
        self._given_precision = None if plugin is None else to_zero_fabric_precision(plugin)
