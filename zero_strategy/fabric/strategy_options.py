"""Moved to zero_strategy/adapter_plumbing/strategy_options.py; this module keeps the old import path working."""

from zero_strategy.adapter_plumbing.strategy_options import START_METHODS, StrategyOptions, strategy_options

__all__ = ["START_METHODS", "StrategyOptions", "strategy_options"]
