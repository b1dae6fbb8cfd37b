"""The Lightning adapter: ZeroStrategy, ZeroPrecision, ShardedCheckpointIO, the profiler and preemption callbacks.
Thin translations of Lightning hooks into core calls; the only part of the package that imports Lightning."""
