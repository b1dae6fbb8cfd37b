"""The comm room: the one place bytes move between ranks.

A :class:`~zero_strategy.core.comm.comm.Comm` per group (all-gather, reduce-scatter, all-reduce, broadcast, barrier;
each returns one :class:`~zero_strategy.core.comm.work.Work`), implementations for one rank, the backend's own
collectives, point-to-point exchanges and shared memory on one host, decorators for CUDA side streams and the
divergence watch, host-wide parameter buffers, and ``EngineComms`` (``engine_comms.py``), which chooses them once
per engine. Nothing outside this room names a transport.
"""
