"""Which precision plugin a ZeroStrategy runs with: always ZeroPrecision, built from the Trainer's own flag."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy

from zero_strategy.lightning.precision import ZeroPrecision


def to_zero_precision(plugin: Precision) -> ZeroPrecision:
    """Translate whatever precision plugin Lightning chose (Precision, MixedPrecision, HalfPrecision) into
    ZeroPrecision, refusing what we cannot honour with ZeroPrecision's error."""
    if isinstance(plugin, ZeroPrecision):
        return plugin
    return ZeroPrecision(str(getattr(plugin, "precision", "32-true")))


def install_precision_selection(strategy_class: type[Strategy]) -> None:
    """Make ``Trainer(strategy=<ZeroStrategy>, precision=...)`` build ZeroPrecision from the user's own flag.

    Lightning special-cases only its own sharded strategies (DeepSpeed, FSDP) when it turns the ``precision``
    flag into a plugin; for any other strategy it builds torch AMP and, on a CPU, silently turns "16-mixed" into
    "bf16-mixed" before the strategy sees it. We add ``strategy_class`` (ZeroStrategy) to that special case, so
    that fp16 really computes in fp16 on a CPU and an unknown precision fails with our message. Idempotent.
    """
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    original = _AcceleratorConnector._check_and_init_precision
    if getattr(original, "_zero_strategy", False):
        return

    def check_and_init_precision(self: _AcceleratorConnector) -> Precision:
        strategy = self.strategy
        if not isinstance(strategy, strategy_class) or isinstance(self._precision_plugin_flag, Precision):
            return original(self)
        own = strategy._precision_plugin  # given to the strategy itself (e.g. from a DeepSpeed config)
        if own is None:
            return ZeroPrecision(self._precision_flag)
        flag = ZeroPrecision(self._precision_flag).precision
        # The Trainer's precision defaults to "32-true", indistinguishable from an explicit "32-true".
        if flag not in ("32-true", own.precision):
            raise ValueError(
                f"precision requested twice: Trainer(precision={self._precision_flag!r}) and the strategy's "
                f"ZeroPrecision({own.precision!r}); set it in one place."
            )
        return own

    check_and_init_precision._zero_strategy = True  # type: ignore[attr-defined]
    _AcceleratorConnector._check_and_init_precision = check_and_init_precision  # type: ignore[method-assign]
