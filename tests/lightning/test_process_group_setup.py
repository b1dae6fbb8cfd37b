"""Each launcher goes through the strategy's own process-group set-up (``setup_environment`` ->
``init_process_group``): the group gets the configured timeout, and it is gone when the rank's process ends (torn
down by the strategy's exit handler where the group outlives fit, see [Note: destroying the process group at exit]
in zero_strategy/core/comm/exit_teardown.py; by teardown under spawn). Launchers: the forked harness as torchrun
(Trainer and Fabric), Lightning's subprocess launcher (a script run once per rank) and its spawn launcher.

Each rank registers an exit observer before the strategy registers its handler, so the observer runs after it
(atexit runs last-in, first-out) and sees what the handler left."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy.fabric.strategy import ZeroFabricStrategy
from zero_strategy.lightning.strategy import ZeroStrategy
from zero_strategy.testing import LAUNCHER_VARIABLES, free_port, run_ranks

TIMEOUT_S = 77.0  # not torch's default (1800 s) nor the harness's (30 s)


def group_timeout_s() -> float:
    """The default group's timeout as its gloo backend holds it."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return float(backend.options._timeout.total_seconds())


def observe_exit(path: Path) -> None:
    atexit.register(lambda: path.write_text(json.dumps({"initialized_at_exit": dist.is_initialized()})))


class Tiny(pl.LightningModule):
    def __init__(self, report: Path | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.report = report

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_start(self) -> None:
        if self.report is None:
            return
        rank = self.trainer.global_rank
        (self.report / f"rank-{rank}.json").write_text(json.dumps({"timeout_s": group_timeout_s()}))
        observe_exit(self.report / f"rank-{rank}-exit.json")  # under spawn: after the strategy's handler exists


def _trainer(strategy: ZeroStrategy) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8)), batch_size=2)


def trainer_rank(rank: int, world: int, folder: str) -> dict:
    observe_exit(Path(folder) / f"rank-{rank}-exit.json")
    assert not dist.is_initialized(), "the harness must leave the group to the strategy"
    trainer = _trainer(ZeroStrategy(stage=2, process_group_timeout_s=TIMEOUT_S))
    trainer.fit(Tiny(), _data())
    return {"timeout_s": group_timeout_s(), "initialized_after_fit": dist.is_initialized(),
            "environment": type(trainer.strategy.cluster_environment).__name__}


def fabric_rank(rank: int, world: int, folder: str) -> dict:
    observe_exit(Path(folder) / f"rank-{rank}-exit.json")
    assert not dist.is_initialized(), "the harness must leave the group to the strategy"
    strategy = ZeroFabricStrategy(stage=2, process_group_timeout_s=TIMEOUT_S)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    module = nn.Linear(4, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    return {"timeout_s": group_timeout_s(), "initialized_after_fit": dist.is_initialized(),
            "environment": type(strategy.cluster_environment).__name__}


def _exits(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank-{rank}-exit.json").read_text()) for rank in range(2)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rank_fn", [trainer_rank, fabric_rank], ids=["trainer", "fabric"])
def test_forked_ranks_as_torchrun_go_through_the_strategys_process_group(tmp_path: Path, rank_fn) -> None:
    results = run_ranks(rank_fn, 2, str(tmp_path), timeout_s=150, init_process_group=False)
    for result in results:
        assert result["environment"] == "TorchElasticEnvironment", result
        assert result["timeout_s"] == TIMEOUT_S, result
        assert result["initialized_after_fit"] is True, "under torchrun the group outlives fit"
    assert _exits(tmp_path) == [{"initialized_at_exit": False}] * 2, "the strategy's exit handler did not destroy it"


# Run once per rank by Lightning's subprocess launcher (rank 0 runs it first and starts rank 1 with LOCAL_RANK=1).
SCRIPT = textwrap.dedent(
    """
    import atexit, json, os
    from pathlib import Path
    import lightning.pytorch as pl, torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from zero_strategy.lightning.strategy import ZeroStrategy

    FOLDER = Path({folder!r})
    RANK = os.environ.get("LOCAL_RANK", "0")  # this rank's, as the launcher gives it (one node)
    atexit.register(lambda: (FOLDER / f"rank-{{RANK}}-exit.json").write_text(
        json.dumps({{"initialized_at_exit": dist.is_initialized()}})))


    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    trainer = pl.Trainer(strategy=ZeroStrategy(stage=2, process_group_timeout_s={timeout!r}), accelerator="cpu",
                         devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8)), batch_size=2))
    timeout_s = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    assert str(trainer.global_rank) == RANK
    (FOLDER / f"rank-{{RANK}}.json").write_text(
        json.dumps({{"timeout_s": timeout_s, "initialized_after_fit": dist.is_initialized()}}))
    """
)


@pytest.mark.timeout(240)
def test_a_script_launched_once_per_rank_goes_through_the_strategys_process_group(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(folder=str(tmp_path), timeout=TIMEOUT_S))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["MASTER_PORT"] = str(free_port())
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=220, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert report == {"timeout_s": TIMEOUT_S, "initialized_after_fit": True}, report
    assert _exits(tmp_path) == [{"initialized_at_exit": False}] * 2, "the strategy's exit handler did not destroy it"


@pytest.mark.timeout(240)
def test_spawned_ranks_go_through_the_strategys_process_group(tmp_path: Path) -> None:
    trainer = _trainer(ZeroStrategy(stage=2, start_method="spawn", process_group_timeout_s=TIMEOUT_S))
    trainer.fit(Tiny(report=tmp_path), _data())
    for rank in range(2):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == {"timeout_s": TIMEOUT_S}
    assert _exits(tmp_path) == [{"initialized_at_exit": False}] * 2, "a spawned rank ended with its group alive"
