"""Moved: the initial values to zero_strategy/initial_values.py, the construction recorder to
zero_strategy/core/init/construction_recorder.py; this module keeps the old import path working."""

from zero_strategy.core.init.construction_recorder import ConstructionRecorder
from zero_strategy.initial_values import initial_values, take_back_released

__all__ = ["ConstructionRecorder", "initial_values", "take_back_released"]
