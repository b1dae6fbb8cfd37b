"""The process group the strategy created is destroyed by an ``atexit`` handler, before interpreter finalization."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist

    # registered first, so it runs after the strategy's handler (atexit runs handlers last-in, first-out)
    atexit.register(lambda: print("initialized at the end:", dist.is_initialized(), flush=True))
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    from zero_strategy.lightning.exit_teardown import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    destroy_process_group_at_exit()  # a second strategy in the same process registers nothing more
    if sys.argv[2] == "destroyed-by-user":
        dist.destroy_process_group()
    print("work done", flush=True)
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["left-to-exit", "destroyed-by-user"])
def test_the_default_group_is_destroyed_at_exit(tmp_path: Path, case: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), case], capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["work done", "initialized at the end: False"], result.stdout
    assert "destroying the process group at exit failed" not in result.stderr
