"""``ZeroConfig.collectives`` takes its default from ``$ZERO_STRATEGY_COLLECTIVES`` (the switch that puts one host's
CPU ranks on the network path; see tests/network_path.py); an explicit value still wins, a bad one is named."""

from __future__ import annotations

import pytest

from zero_strategy.config import COLLECTIVES_ENV, ZeroConfig, ZeroConfigError


@pytest.mark.timeout(10)
def test_unset_or_empty_means_auto(monkeypatch):
    monkeypatch.delenv(COLLECTIVES_ENV, raising=False)
    assert ZeroConfig().collectives == "auto"
    monkeypatch.setenv(COLLECTIVES_ENV, "")
    assert ZeroConfig().collectives == "auto"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("choice", ["native", "point_to_point", "shared_memory", "auto"])
def test_the_variable_is_the_default(monkeypatch, choice):
    monkeypatch.setenv(COLLECTIVES_ENV, choice)
    assert ZeroConfig().collectives == choice
    assert ZeroConfig.from_kwargs(stage=2).collectives == choice


@pytest.mark.timeout(10)
def test_an_explicit_value_wins(monkeypatch):
    monkeypatch.setenv(COLLECTIVES_ENV, "point_to_point")
    assert ZeroConfig(collectives="auto").collectives == "auto"
    assert ZeroConfig.from_kwargs(collectives="native").collectives == "native"


@pytest.mark.timeout(10)
def test_a_bad_value_is_named_with_the_choices(monkeypatch):
    monkeypatch.setenv(COLLECTIVES_ENV, "nccl")
    with pytest.raises(ZeroConfigError, match=r"\$ZERO_STRATEGY_COLLECTIVES='nccl'.*'point_to_point'.*unset it"):
        ZeroConfig()
    # an explicit value never reads the variable
    assert ZeroConfig(collectives="point_to_point").collectives == "point_to_point"
