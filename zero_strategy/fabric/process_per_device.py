"""Moved to zero_strategy/adapter_plumbing/process_per_device.py; this module keeps the old import path working."""

from zero_strategy.adapter_plumbing.process_per_device import ProcessPerDevice

__all__ = ["ProcessPerDevice"]
