"""Preemption on SLURM (``SLURMEnvironment(auto_requeue=True)``): the checkpoint Lightning's requeue signal asks
for is written at an optimizer-step boundary that every rank agrees on.

[Note: preemption saves at a step boundary]
Lightning's handler for the requeue signal (``SIGUSR1`` by default) calls ``trainer.save_checkpoint`` from inside
the signal handler, on every rank that received the signal, wherever that rank's main thread is: possibly between
two collectives of a step, possibly on one rank only or at different moments on different ranks. Our save is
collective (every rank writes its shard), so run there it would interleave with the step's gathers and reductions
differently on different ranks: a hang, or a checkpoint of half-updated slices. Instead the handler only records
the request. After each optimizer step (``on_train_batch_end`` when ``global_step`` moved: the point where a
``ModelCheckpoint(every_n_train_steps=...)`` saves, which Lightning resumes exactly) every rank all-reduces its
flag — one small reduction per optimizer step, only under SLURM auto-requeue — and if any rank was signalled,
every rank runs Lightning's own handler there, together: loggers finalized, the ``hpc_ckpt_N.ckpt`` directory
saved, ``scontrol requeue`` called by rank 0. A signal during the last optimizer step is served when training ends.
Mid-accumulation the save waits for the window's step (saving then would lose the gradients accumulated so far).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from typing_extensions import override


class PreemptionSaver(Callback):
    """Turns Lightning's requeue-signal save into a request served at the next agreed step boundary."""

    def __init__(self, connector: _SignalConnector) -> None:
        self._connector = connector
        self.requested = False
        self._signum: int = int(signal.SIGUSR1)
        self._last_step = -1

    def request(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: only remember (see [Note: preemption saves at a step boundary])."""
        self.requested = True
        self._signum = int(signum)

    def _serve_if_requested(self, trainer: pl.Trainer) -> None:
        # Collective: every rank calls this at the same points, so all agree on whether anyone was signalled.
        if not trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            return
        self.requested = False
        # Lightning's own handler, now on every rank at the same point of the run.
        _SignalConnector._slurm_sigusr_handler_fn(self._connector, self._signum, None)  # type: ignore[arg-type]

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._last_step:
            return  # no optimizer step in this batch (accumulation): not a boundary
        self._last_step = trainer.global_step
        self._serve_if_requested(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._serve_if_requested(trainer)


def install_preemption_saver(trainer: pl.Trainer) -> None:
    """Under SLURM auto-requeue, route Lightning's requeue-signal save through a :class:`PreemptionSaver`.

    Called from the strategy's ``setup``, which Lightning runs before it registers its signal handlers: the
    handler it then registers is the saver's ``request``. Idempotent (fit after fit on one Trainer)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = trainer._accelerator_connector.cluster_environment
    if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    saver = next((c for c in callbacks if isinstance(c, PreemptionSaver)), None)
    if saver is None:
        saver = PreemptionSaver(trainer._signal_connector)
        callbacks.append(saver)
    # An instance attribute shadows the method Lightning looks up when it registers the handler.
    setattr(trainer._signal_connector, "_slurm_sigusr_handler_fn", saver.request)  # noqa: B010
