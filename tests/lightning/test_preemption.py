"""SLURM preemption: ``SLURMEnvironment(auto_requeue=True)`` saves on ``SIGUSR1`` through the strategy, and under
zero3 that save is a complete sharded checkpoint from which the requeued job resumes exactly.

Two ranks are forked by run_ranks, each with the variables ``srun`` sets for its task (no launcher: Lightning takes
the processes for SLURM's), with a fake ``scontrol`` on PATH that records its arguments. The signal reaches rank 1
alone, in the middle of a step (before its forward; rank 1 sends it to itself, as a process-directed signal from
SLURM would arrive), while rank 0 is inside that step's collectives: Lightning's handler would save right there,
on one rank (a hang). The reference for "exactly" is the signalled run itself, which goes on to the end after the
save: the requeued run, forked afresh and resumed from the save, must end on the same weights.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.lit import LitTiedLM, state_of, train_loader, trainer_kwargs
from lightning.fabric.plugins.environments import SLURMEnvironment

from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.base.format import MANIFEST_NAME
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.testing import run_ranks

JOB_ID = "4242"
# The signal comes during the last batch of the first epoch (7 per rank), so the save lands on an epoch boundary:
# Lightning restarts a plain DataLoader from the epoch's first batch when it resumes mid-epoch (DDP as well), and
# with accumulation an epoch-end save resumes one micro-batch short (LIGHTNING.md), which would hide what is tested.
ACCUMULATE = 1
SIGNAL_AT_BATCH = 6
SAVED_AT_STEP = 7
MAX_STEPS = 10
LAUNCHER_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "RANK", "PL_GLOBAL_SEED")


class Signalled(LitTiedLM):
    def __init__(self, signal_at: int | None) -> None:
        super().__init__()
        self.signal_at, self.start_step, self.signalled = signal_at, None, False

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step
        self.seen.append([])  # a run resumed mid-epoch gets no on_train_epoch_start for that epoch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.signal_at == batch_idx and self.global_rank == 1 and self.current_epoch == 0:
            time.sleep(0.3)  # rank 0 is inside this step's collectives by now, waiting for rank 1
            os.kill(os.getpid(), signal.SIGUSR1)  # rank 1 only; its handler runs before the next line
            self.signalled = True
        return super().training_step(batch, batch_idx)


def _become_slurm_task(rank: int, world: int, out: Path) -> None:
    """Set what srun sets for task ``rank`` of a ``world``-task job on one node (and nothing a launcher sets)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")] + list(LAUNCHER_VARIABLES):
        os.environ.pop(key, None)
    os.environ.update(
        SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train", SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(world),
        SLURM_NNODES="1", SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1", SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank), PATH=f"{out / 'bin'}{os.pathsep}{os.environ['PATH']}",
    )  # fmt: skip


def fit_as_slurm_task(rank: int, world: int, out: str, mode: str) -> dict[str, Any]:
    """One task of the job: the first run (``mode="first"``, signalled) or the requeued one, which finds
    ``hpc_ckpt_1.ckpt`` itself, as on SLURM. Returns the final weights and the steps the fit started and ended at."""
    _become_slurm_task(rank, world, Path(out))
    pl.seed_everything(0, verbose=False)
    model = Signalled(SIGNAL_AT_BATCH if mode == "first" else None)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, process_group_timeout_s=60),
        plugins=[SLURMEnvironment(auto_requeue=True)],
        default_root_dir=out,
        **trainer_kwargs(max_epochs=-1, max_steps=MAX_STEPS, accumulate_grad_batches=ACCUMULATE),
    )
    trainer.fit(model, train_loader())
    return {"final": state_of(model), "start": model.start_step, "end": trainer.global_step,
            "signalled": model.signalled}  # fmt: skip


@pytest.mark.timeout(120)  # measured: 1.5 s (both runs)
def test_sigusr1_saves_a_sharded_checkpoint_at_a_step_boundary_and_the_requeued_run_resumes(tmp_path):
    out = tmp_path
    (out / "bin").mkdir()
    scontrol = out / "bin" / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol.log"}\n')
    scontrol.chmod(0o755)

    first = run_ranks(fit_as_slurm_task, 2, str(out), "first", timeout_s=50)
    assert first[1]["signalled"], "rank 1 never reached the step"
    assert (out / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"]
    saved = out / "hpc_ckpt_1.ckpt"
    assert saved.is_dir() and (saved / MANIFEST_NAME).is_file()
    with ShardedCheckpoint(saved) as ckpt:
        assert ckpt.manifest.has_optimizer_state and ckpt.manifest.world_size == 2
        assert ckpt.trainer_state()["global_step"] == SAVED_AT_STEP

    requeued = run_ranks(fit_as_slurm_task, 2, str(out), "requeued", timeout_s=50)
    for rank in range(2):
        assert (first[rank]["start"], first[rank]["end"]) == (0, MAX_STEPS)
        assert (requeued[rank]["start"], requeued[rank]["end"]) == (SAVED_AT_STEP, MAX_STEPS)
        for key, value in first[rank]["final"].items():
            assert torch.equal(requeued[rank]["final"][key], value), f"rank {rank}: {key} differs after the requeue"
    assert (out / "scontrol.log").read_text().splitlines() == [f"requeue {JOB_ID}"]
