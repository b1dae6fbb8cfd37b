"""Moved to zero_strategy/adapter_plumbing/forward_entry.py; this module keeps the old import path working."""

from zero_strategy.adapter_plumbing.forward_entry import ForwardEntry

__all__ = ["ForwardEntry"]
