"""Registration with Lightning and the strategy's constructor checks (no processes launched)."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import zero_strategy
from zero_strategy import ZeroConfig, ZeroConfigError, ZeroStrategy

NAMES = {f"zero{s}{suffix}": (s, method) for s in (1, 2, 3) for suffix, method in (("", "popen"), ("_spawn", "spawn"))}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(NAMES))
def test_names_registered(name):
    stage, start_method = NAMES[name]
    assert name in StrategyRegistry
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.config.stage == stage
    assert strategy._start_method == start_method


@pytest.mark.timeout(30)
def test_registration_is_idempotent():
    ZeroStrategy.register_strategies(StrategyRegistry)  # a second import-time registration must not raise
    assert zero_strategy.ZeroStrategy is ZeroStrategy


@pytest.mark.timeout(30)
def test_strategy_options():
    strategy = ZeroStrategy(stage=2, prefetch=False, allow_untested_optimizer=True)
    config = strategy.config
    assert (config.stage, config.prefetch, config.allow_untested_optimizer) == (2, False, True)
    assert ZeroStrategy(config=ZeroConfig(stage=1)).config.stage == 1
    assert strategy.is_distributed


@pytest.mark.timeout(30)
def test_strategy_rejects_bad_options():
    with pytest.raises(ZeroConfigError, match="stage"):
        ZeroStrategy(stage=7)
    with pytest.raises(ZeroConfigError, match="bogus_option"):
        ZeroStrategy(stage=2, bogus_option=1)
    with pytest.raises(ValueError, match="start_method"):
        ZeroStrategy(stage=2, start_method="thread")


@pytest.mark.timeout(30)
def test_registry_holds_exactly_the_listed_names():
    from zero_strategy.names import STRATEGY_NAMES

    available = StrategyRegistry.available_strategies()
    ours = {name for name in available if StrategyRegistry[name]["strategy"] is ZeroStrategy}
    assert ours == {entry.name for entry in STRATEGY_NAMES}
    for entry in STRATEGY_NAMES:
        strategy = StrategyRegistry.get(entry.name)
        assert (strategy.config.zero_stage, strategy._start_method) == (entry.stage, entry.start_method)
        assert {key: getattr(strategy.config, key) for key in entry.options} == dict(entry.options)
