"""The Lightning Trainer adapter: ZeroStrategy, ZeroPrecision, ShardedCheckpointIO, the profiler and preemption
callbacks. Thin translations of the Trainer's hooks into core and checkpoint calls. Lightning is imported only here,
in the Fabric adapter (zero_strategy/fabric/) and in the plumbing both share (zero_strategy/adapter_plumbing/);
tests/unit/test_package_rooms.py runs the rest of the package with Lightning blocked."""
