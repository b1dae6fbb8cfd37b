"""Both strategies (the Trainer's and Fabric's) read their constructor arguments the same way: ``config=`` or its
fields as keywords (not both), a ``stage`` that must agree with the config, activation checkpointing given as class
names (kept in the config, as a config file holds them) or as classes and callables (kept beside it)."""

from __future__ import annotations

import pytest
from torch import nn

from zero_strategy import ZeroConfig, ZeroFabricStrategy, ZeroStrategy

STRATEGIES = [ZeroStrategy, ZeroFabricStrategy]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.__name__)
def test_bad_arguments_are_errors_naming_them(strategy: type) -> None:
    with pytest.raises(ValueError, match=r"either as config= or as keywords, not both \(got \['prefetch'\]\)"):
        strategy(config=ZeroConfig(stage=2), prefetch=False)
    with pytest.raises(ValueError, match=r"stage=3 disagrees with config\.stage=2"):
        strategy(3, config=ZeroConfig(stage=2))
    with pytest.raises(ValueError, match="start_method='thread'"):
        strategy(3, start_method="thread")
    with pytest.raises(ValueError, match=r"unknown ZeRO option\(s\) \['prefech'\]"):
        strategy(3, prefech=False)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.__name__)
def test_activation_checkpointing_by_name_goes_into_the_config_and_by_class_beside_it(strategy: type) -> None:
    by_name = strategy(3, activation_checkpointing=["Sequential"])
    assert by_name.config.activation_checkpointing == ["Sequential"]
    assert by_name._checkpoint_policy(nn.Sequential()) and not by_name._checkpoint_policy(nn.Linear(1, 1))
    by_class = strategy(3, activation_checkpointing=[nn.Linear])
    assert by_class.config.activation_checkpointing == []
    assert by_class._checkpoint_policy(nn.Linear(1, 1)) and not by_class._checkpoint_policy(nn.Sequential())
    from_config = strategy(config=ZeroConfig(stage=1, activation_checkpointing=["Linear"]))
    assert from_config._checkpoint_policy(nn.Linear(1, 1))
    assert strategy(2)._checkpoint_policy is None
