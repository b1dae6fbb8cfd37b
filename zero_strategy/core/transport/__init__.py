"""The one place bytes move between ranks: every gather, reduction, all-reduce, broadcast and barrier the core
issues goes through this package, and how they travel is decided here once per engine (``choice.py``).

- ``collectives.py``: stateless collectives taking a process group, recording bytes and blocked time;
- ``point_to_point.py``: all-gather / reduce-scatter as point-to-point exchanges (gloo: about twice as fast);
- ``shared_shards.py``: stage 3 on one host's CPU ranks — each unit's parameters once per host in ``/dev/shm``,
  read in place (no gathers);
- ``gather_watch.py``: network gathers of different units on different ranks fail fast instead of hanging;
- ``choice.py``: which of these an engine uses, from the backend, the stage, offload and the host.
"""
