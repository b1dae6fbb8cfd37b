"""Moved to zero_strategy/adapter_plumbing/process_group.py; this module keeps the old import path working."""

from zero_strategy.adapter_plumbing.process_group import barrier, broadcast_object, init_process_group, rank_layout

__all__ = ["barrier", "broadcast_object", "init_process_group", "rank_layout"]
