"""Lightning's loop state for a checkpoint DeepSpeed's plain engine wrote (no Lightning in it): what
``trainer.fit(ckpt_path=DEEPSPEED_DIR)`` restores so that the fit continues at DeepSpeed's step count.

[Note: resuming a plain DeepSpeed engine's checkpoint]
A plain engine records how many optimizer steps it took (``global_steps``) and its LR scheduler, nothing about
epochs or data position. The fit therefore resumes at the start of an epoch (epoch 0, its first batch) with
``trainer.global_step`` equal to DeepSpeed's ``global_steps``: the optimizer-step and scheduler counters of this
Trainer's own fit loop are set to it, everything else left as a new fit has it. Feed the data from where the
DeepSpeed run stopped (``max_steps`` counts from DeepSpeed's step count).
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl


def loops_at_global_step(trainer: pl.Trainer, global_step: int) -> dict[str, Any]:
    """Lightning's ``loops`` checkpoint entry for a fit at epoch 0, batch 0, ``global_step`` optimizer steps done
    (see [Note: resuming a plain DeepSpeed engine's checkpoint])."""
    fit = copy.deepcopy(trainer.fit_loop.state_dict())
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = global_step
    optimizer = fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    optimizer["step"]["total"].update(ready=global_step, completed=global_step)
    optimizer["zero_grad"]["total"].update(ready=global_step, started=global_step, completed=global_step)
    fit["epoch_loop.scheduler_progress"]["total"].update(ready=global_step, completed=global_step)
    return {
        "fit_loop": fit,
        "validate_loop": trainer.validate_loop.state_dict(),
        "test_loop": trainer.test_loop.state_dict(),
        "predict_loop": trainer.predict_loop.state_dict(),
    }
