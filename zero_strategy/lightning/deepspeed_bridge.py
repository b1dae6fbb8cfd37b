"""Applying an imported DeepSpeed config to a run: the Trainer-side checks a strategy cannot do at construction.

DeepSpeed's batch keys and ``gradient_clipping`` describe settings that belong to the Trainer and the DataLoader in
Lightning. They are checked (and "auto" / missing values filled) when training starts, and disagreements stop the
run with every number shown, before the first step.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from zero_strategy.deepspeed_import import DeepSpeedConfigError, DeepSpeedImport


def apply_clipping(imported: DeepSpeedImport, trainer: Trainer) -> None:
    """Use the config's ``gradient_clipping`` unless the Trainer sets a different value (an error)."""
    wanted = imported.gradient_clip_val
    if wanted is None:
        return
    current = trainer.gradient_clip_val
    if current is None:
        trainer.gradient_clip_val = wanted
    elif float(current) != float(wanted):
        raise DeepSpeedConfigError(
            f"{imported.source}: gradient_clipping={wanted} but Trainer(gradient_clip_val={current}); "
            "remove one of them or make them equal."
        )


def check_batch(imported: DeepSpeedImport, trainer: Trainer, world_size: int) -> Any:
    """Resolve the DeepSpeed batch keys against the Trainer and the training DataLoader (raises on a mismatch)."""
    loader = trainer.train_dataloader
    micro_batch = getattr(loader, "batch_size", None)
    if not isinstance(micro_batch, int):
        raise DeepSpeedConfigError(
            f"{imported.source}: the DeepSpeed batch keys need a training DataLoader with an integer batch_size "
            f"to check against (got {micro_batch!r})."
        )
    return imported.batch.resolve(world_size, micro_batch, trainer.accumulate_grad_batches)
