"""Moved to zero_strategy/core/comm/exit_teardown.py; this module keeps the old import path working."""

from zero_strategy.core.comm.exit_teardown import destroy_process_group_at_exit

__all__ = ["destroy_process_group_at_exit"]
