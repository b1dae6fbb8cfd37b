"""``python -m zero_strategy.checkpoint``: the ``zero-to-fp32`` command, which lives in
``zero_strategy.checkpoint.export.cli`` (this was its module before the checkpoint rooms)."""

import sys

from zero_strategy.checkpoint.export.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
