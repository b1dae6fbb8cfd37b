"""The README's ten-line example, run verbatim: its code block is read from README.md at test time (so editing the
README re-tests it), the ``from my_project import ...`` line replaced by a tiny module and dataloader, and run as a
script (the plain "zero3" name re-runs it for rank 1) on 2 CPU ranks. The checkpoint it saves after ``fit`` must
be the sharded directory, resume a fit with its optimizer state, and be what ``consolidate`` turned into the file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zero_strategy.checkpoint.base.format import MANIFEST_NAME
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint

README = Path(__file__).resolve().parents[2] / "README.md"
IMPORT_LINE = "from my_project import MyLightningModule, my_dataloader"
CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}
STOP_AT = 2  # optimizer steps the stand-in module trains before it stops the README's max_steps=1000 run

# Stands in for the user's project. It ends training after STOP_AT optimizer steps (Trainer.should_stop), so the
# README's max_steps=1000 runs in seconds.
TINY_PROJECT = f"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyLightningModule(pl.LightningModule):
    def __init__(self, stop_at={STOP_AT}):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.stop_at, self.start_step = stop_at, None

    def on_train_start(self):
        self.start_step = self.trainer.global_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.stop_at is not None and self.trainer.global_step >= self.stop_at:
            self.trainer.should_stop = True

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


torch.manual_seed(0)
my_dataloader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64)), batch_size=4)
"""

# Appended after the README's code (not part of it): record, then resume a fit from the saved directory.
AFTER = f"""
fitted = {{k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}}
resumed = MyLightningModule(stop_at=None)
again = pl.Trainer(strategy="zero3", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False,
                   accumulate_grad_batches=4, gradient_clip_val=1.0, max_steps={STOP_AT + 2},
                   enable_checkpointing=False, enable_progress_bar=False)
again.fit(resumed, my_dataloader, ckpt_path="run.ckpt")
torch.save({{"fitted": fitted, "start": resumed.start_step, "end": again.global_step}},
           f"result_rank{{trainer.global_rank}}.pt")
"""


def readme_example() -> str:
    text = README.read_text()
    section = text.split("## Ten-line example", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README.md: no python code block under '## Ten-line example'"
    code = match.group(1)
    assert IMPORT_LINE in code, f"README.md's example no longer imports with {IMPORT_LINE!r}; update this test"
    return code


@pytest.mark.timeout(180)
def test_readme_ten_line_example_runs_resumes_and_consolidates(tmp_path):
    script = readme_example().replace(IMPORT_LINE, TINY_PROJECT) + AFTER
    (tmp_path / "example.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    proc = subprocess.run(
        [sys.executable, "example.py"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    ckpt = tmp_path / "run.ckpt"
    assert ckpt.is_dir() and (ckpt / MANIFEST_NAME).is_file()
    with ShardedCheckpoint(ckpt) as opened:
        assert opened.manifest.has_optimizer_state and opened.manifest.world_size == 2
        assert opened.trainer_state()["global_step"] == STOP_AT
    consolidated = load_file(tmp_path / "model.safetensors")
    for rank in range(2):
        result = torch.load(tmp_path / f"result_rank{rank}.pt", weights_only=False)
        assert (result["start"], result["end"]) == (STOP_AT, STOP_AT + 2), f"rank {rank} did not resume"
        assert list(consolidated) == list(result["fitted"])
        for key, value in result["fitted"].items():
            assert torch.equal(consolidated[key], value), f"rank {rank}: consolidated {key} is not the fitted one"
