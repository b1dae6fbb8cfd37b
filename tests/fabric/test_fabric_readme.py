"""The README's Fabric example, run verbatim: its code block is read from README.md at test time, the ``from
my_project import ...`` line replaced by a tiny model and data loader, and run as a script (the plain "zero3" name
re-runs it for rank 1) on 2 CPU ranks. Its sharded checkpoint must hold the trained fp32 weights (consolidated) and
its optimizer state, and load back into a fresh model and optimizer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_strategy import consolidate
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint

README = Path(__file__).resolve().parents[2] / "README.md"
IMPORT_LINE = "from my_project import MyModel, my_dataloader"
CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}

TINY_PROJECT = """
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = layer(x).tanh()
        return self.layers[-1](x)


torch.manual_seed(0)
my_dataloader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
"""

# Appended after the README's code: a fresh model and optimizer load the checkpoint.
AFTER = """
state = {"model": fabric.setup_module(MyModel()), "step": -1}
state["optimizer"] = fabric.setup_optimizers(torch.optim.AdamW(state["model"].parameters(), lr=1e-3))
fabric.load("run.ckpt", state)
steps = [float(s["step"]) for s in state["optimizer"].state.values()]
fabric.strategy.engine(state["model"]).release(full=True)  # the module takes its fp32 masters back
loaded = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
torch.save({"step": state["step"], "loaded": loaded, "optimizer_steps": steps}, f"result_rank{fabric.global_rank}.pt")
"""


def readme_fabric_example() -> str:
    section = README.read_text().split("## Lightning Fabric", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README.md: no python code block under '## Lightning Fabric'"
    code = match.group(1)
    assert IMPORT_LINE in code, f"README.md's Fabric example no longer imports with {IMPORT_LINE!r}; update this test"
    return code


@pytest.mark.timeout(180)
def test_readme_fabric_example_trains_saves_and_loads(tmp_path: Path) -> None:
    script = readme_fabric_example().replace(IMPORT_LINE, TINY_PROJECT) + AFTER
    (tmp_path / "example.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    done = subprocess.run([sys.executable, "example.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    with ShardedCheckpoint(tmp_path / "run.ckpt") as opened:
        assert opened.manifest.has_optimizer_state and opened.manifest.world_size == 2
        assert opened.manifest.stage == 3 and opened.manifest.precision == "bf16-mixed"
    weights = torch.load(consolidate(tmp_path / "run.ckpt", tmp_path / "model.pt"), weights_only=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"result_rank{rank}.pt", weights_only=True)
        assert result["step"] == 7  # the last micro-batch index: 64 samples, batches of 4, 2 ranks
        assert result["optimizer_steps"] and set(result["optimizer_steps"]) == {2.0}  # 2 AdamW steps of 4 each
        assert list(result["loaded"]) == list(weights)
        for key, value in weights.items():  # the saved fp32 masters, loaded into the fresh model's slices
            assert torch.equal(result["loaded"][key], value), (rank, key)
