"""Moved to zero_strategy/core/comm/engine_comms.py (``CommPlan`` is now ``EngineComms``); this module keeps the
old import path working. To change a module-level setting (``ARENA_CAP_BYTES``, ``free_bytes``), set it on
engine_comms: setting it here changes nothing."""

from zero_strategy.core.comm.engine_comms import (
    ARENA_CAP_BYTES,
    ARENAS,
    EngineComms,
    ReplicaComm,
    local_comm,
    network_comm,
    watch_applies,
)

CommPlan = EngineComms

__all__ = ["ARENAS", "ARENA_CAP_BYTES", "CommPlan", "EngineComms", "ReplicaComm", "local_comm", "network_comm",
           "watch_applies"]
