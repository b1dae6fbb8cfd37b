"""Old import path of ``zero_strategy.checkpoint.dcp.cli`` (the ``zero-to-dcp`` command's module now); kept for an
entry point installed before the checkpoint rooms."""

from zero_strategy.checkpoint.dcp.cli import main

__all__ = ["main"]
