"""``python -m zero_strategy.fabric run ...``: see zero_strategy/fabric/cli.py."""

from zero_strategy.fabric.cli import main

main()
