"""Developer benchmarks (not installed with the package): ``python -m benchmarks.benchmark`` from the repository
root compares ZeRO with DDP, ZeroRedundancyOptimizer, FSDP2 (and DeepSpeed where installed)."""
