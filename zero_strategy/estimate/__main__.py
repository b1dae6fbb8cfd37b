"""``python -m zero_strategy.estimate``: the ``zero-estimate`` command."""

import sys

from zero_strategy.estimate.cli import main

sys.exit(main())
