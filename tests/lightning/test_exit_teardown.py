"""The process group the strategy created is destroyed by an ``atexit`` handler, before interpreter finalization."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Registered before anything of ours, so it runs after the strategy's handler (atexit runs last-in, first-out).
REPORT_AT_EXIT = """
import atexit
import torch.distributed as dist
atexit.register(lambda: print("initialized at the end:", dist.is_initialized(), flush=True))
"""

# A popen-launched fit (one rank, so the script is not re-run): the process group outlives fit, as for saving.
AFTER_A_FIT = REPORT_AT_EXIT + textwrap.dedent(
    """
    import lightning.pytorch as pl, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import zero_strategy


    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8)), batch_size=4)
    trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data)
    print("after fit:", dist.is_initialized(), flush=True)
    """
)

# The user destroyed the group first: the handler has nothing to do and must not fail.
DESTROYED_BY_USER = REPORT_AT_EXIT + textwrap.dedent(
    """
    import sys
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    from zero_strategy.core.comm.exit_teardown import destroy_process_group_at_exit

    destroy_process_group_at_exit()
    destroy_process_group_at_exit()  # a second strategy in the same process registers nothing more
    dist.destroy_process_group()
    print("after fit:", dist.is_initialized(), flush=True)
    """
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("script", "alive_after_fit"), [(AFTER_A_FIT, True), (DESTROYED_BY_USER, False)])
def test_the_default_group_is_destroyed_at_exit(tmp_path: Path, script: str, alive_after_fit: bool) -> None:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in {"LOCAL_RANK", "WORLD_SIZE", "RANK"}}
    result = subprocess.run(
        [sys.executable, str(path), str(tmp_path / "store")], capture_output=True, text=True, timeout=80, env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("after fit:", "initialized at the end:"))]
    assert lines == [f"after fit: {alive_after_fit}", "initialized at the end: False"], result.stdout[-3000:]
    assert "destroying the process group at exit failed" not in result.stderr
