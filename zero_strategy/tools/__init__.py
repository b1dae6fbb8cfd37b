"""Command-line tools built on the core: ``python -m zero_strategy.tools.benchmark`` compares ZeRO with DDP/FSDP2."""
