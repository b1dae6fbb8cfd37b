"""Multi-node launches proven on one host: 2 "nodes" × 2 ranks started by ``torchrun --nnodes=2`` (one agent per
node) and by the variables ``srun`` sets (Lightning's SLURMEnvironment). Node membership comes from the launcher,
not the hostname, so the strategy must see 2 nodes, keep its gathers inside each node (``shard_group_size="node"``)
and match DDP run by the same script under the same launch. The commands are the README's "Several machines"
recipe; ``examples/train.py`` runs under the same torchrun pair."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.compare import assert_state_close

from zero_strategy.testing import free_port

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SCRIPT = TESTS / "lightning" / "multinode_script.py"
LAUNCH_ENV = ("LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun_pair(args: list[str], timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """``torchrun --nnodes=2 --node_rank=0|1 --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=P ARGS``."""
    port = free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2",
             "--master_addr=127.0.0.1", f"--master_port={port}", *args],
            cwd=REPO, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    return [_finish(agent, timeout) for agent in agents]


def slurm_tasks(
    args: list[str], timeout: float, extra_env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Four processes with what ``srun --nodes=2 --ntasks-per-node=2`` sets for each task."""
    port = free_port()
    tasks = []
    for rank in range(4):
        env = _clean_env() | (extra_env or {}) | {
            "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2), "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "zero-multinode", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        tasks.append(subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return [_finish(task, timeout) for task in tasks]


def _finish(proc: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        output += "\n[killed: timeout]"
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def _assert_ok(runs: list[subprocess.CompletedProcess[str]]) -> None:
    for run in runs:
        assert run.returncode == 0, f"{run.args} failed:\n{run.stdout[-4000:]}"


def _assert_parity_and_two_nodes(out: Path, env_name: str) -> None:
    for rank in range(4):
        ddp = torch.load(out / f"ddp_rank{rank}.pt")
        zero = torch.load(out / f"zero_rank{rank}.pt")
        assert (zero["env"], zero["num_nodes"], zero["nodes"]) == (env_name, 2, 2)
        assert (zero["shard_world"], zero["replicas"]) == (2, 2), "shard groups of one node, replicated"
        assert zero["links"]["inter_node"] > 0 and zero["links"]["intra_node"] > 0
        assert_state_close(zero["state"], ddp["state"], rel=1e-5, what=f"{env_name} rank {rank} vs DDP")
        assert any(not torch.equal(ddp["state"][k], ddp["initial"][k]) for k in ddp["state"]), "training moved nothing"


TRAIN_ARGS = [
    "examples/train.py", "trainer.num_nodes=2", "trainer.devices=2", "strategy=zero3", "strategy.shard_group_size=node",
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=8",
    "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "model.warmup_steps=0",
    "strategy.process_group_timeout_s=60", "trainer.enable_progress_bar=false",
]


@pytest.mark.timeout(150)
def test_torchrun_two_nodes_match_ddp_and_train_example_runs(tmp_path: Path) -> None:
    _assert_ok(torchrun_pair([str(SCRIPT), str(tmp_path)], timeout=90))
    _assert_parity_and_two_nodes(tmp_path, "TorchElasticEnvironment")
    runs = torchrun_pair([*TRAIN_ARGS, f"hydra.run.dir={tmp_path / 'train'}"], timeout=50)
    _assert_ok(runs)
    assert "4 rank(s)" in runs[0].stdout and "final val_loss=" in runs[0].stdout, runs[0].stdout[-3000:]


@pytest.mark.timeout(130)
def test_slurm_variables_two_nodes_match_ddp(tmp_path: Path) -> None:
    _assert_ok(slurm_tasks([str(SCRIPT), str(tmp_path)], timeout=110, extra_env={"ZERO_HIERARCHICAL": "1"}))
    _assert_parity_and_two_nodes(tmp_path, "SLURMEnvironment")
    for rank in range(4):  # hierarchical stage 3 through Lightning: nodes from SLURM's variables, parity with DDP
        ddp, hier = torch.load(tmp_path / f"ddp_rank{rank}.pt"), torch.load(tmp_path / f"hierarchical_rank{rank}.pt")
        assert (hier["nodes"], hier["shard_world"], hier["param_group"]) == (2, 4, 2)
        assert_state_close(hier["state"], ddp["state"], rel=1e-5, what=f"hierarchical rank {rank} vs DDP")
