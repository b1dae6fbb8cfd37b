"""An install with a torch that is too old fails at import with a message naming the need."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.timeout(60)
def test_old_torch_fails_at_import_naming_the_version_needed():
    # torch < 2.6 has isend(tensor, dst, group, tag) without group_dst: stand one in before the package is imported
    script = textwrap.dedent(
        """
        import torch.distributed as dist

        def isend(tensor, dst=None, group=None, tag=0):
            raise AssertionError("not reached")

        dist.isend = isend
        import zero_strategy
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert result.returncode != 0
    assert "ImportError: zero_strategy needs torch >= 2.6" in result.stderr, result.stderr[-2000:]
    assert "pip install 'torch>=2.6'" in result.stderr


def test_current_torch_passes_the_check():
    from zero_strategy._requirements import check_torch

    check_torch()
