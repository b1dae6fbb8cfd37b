"""ZeroStage's derived properties and ZeroConfig validation (single process, no communication)."""

from __future__ import annotations

import pytest

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.stage import ZeroStage


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("stage", "reduces_every_microstep", "reshards_parameters"),
    [(1, False, False), (2, True, False), (3, True, True)],
)
def test_stage_properties(stage, reduces_every_microstep, reshards_parameters):
    s = ZeroStage(stage)
    assert int(s) == stage
    assert s.reduces_every_microstep is reduces_every_microstep
    assert s.reshards_parameters is reshards_parameters


@pytest.mark.timeout(10)
def test_stage_names_and_invalid_values():
    assert ZeroStage.OPTIMIZER_STATES == 1
    assert ZeroStage.GRADIENTS == 2
    assert ZeroStage.PARAMETERS == 3
    for bad in (0, 4, 7):
        with pytest.raises(ValueError):
            ZeroStage(bad)


@pytest.mark.timeout(10)
def test_config_defaults_and_keywords():
    config = ZeroConfig()
    assert config.stage == 3
    assert config.unit_modules == []
    assert config.allow_untested_optimizer is False
    built = ZeroConfig.from_kwargs(stage=2, prefetch=False, unit_modules=["Block"])
    assert (built.stage, built.prefetch, built.unit_modules) == (2, False, ["Block"])
    # each config gets its own list (a shared mutable default would leak between configs)
    assert ZeroConfig().unit_modules is not ZeroConfig().unit_modules


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"stage": 7}, "stage"),
        ({"stage": 0}, "stage"),
        ({"unit_modules": "Block"}, "unit_modules"),
        ({"min_unit_numel": 0}, "min_unit_numel"),
        ({"process_group_timeout_s": 0}, "process_group_timeout_s"),
        ({"process_group_timeout_s": -5.0}, "process_group_timeout_s"),
    ],
)
def test_config_validation_names_the_key(kwargs, key):
    with pytest.raises(ZeroConfigError, match=key):
        ZeroConfig(**kwargs)
    with pytest.raises(ZeroConfigError, match=key):
        ZeroConfig.from_kwargs(**kwargs)


@pytest.mark.timeout(10)
def test_stage_7_message_names_value():
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig(stage=7)
    message = str(info.value)
    assert "stage" in message and "7" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.timeout(10)
def test_unknown_keyword_is_named():
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_kwargs(stage=2, stagee=3, prefetchh=True)
    message = str(info.value)
    assert "stagee" in message and "prefetchh" in message
    assert "min_unit_numel" in message  # the valid options are listed
