"""CommunicationProfiler: per optimizer step, where the time went and what was sent.

Per step it reports the wall time, the time this rank was blocked in each collective kind (communication that was
*not* hidden behind compute), the compute time (the rest), the bytes per collective kind and the bandwidth they
achieved while blocking. It logs through the Trainer's loggers (TensorBoard, CSV, W&B alike) and prints a summary
table with the topology when ``fit`` ends. Switch it on with ``ZeroStrategy(profile=True)`` or add it as a callback.

On a GPU, NCCL runs on its own stream and collectives return at once: the blocked time is then the host-side time
only, and for kernel-level overlap use ``torch.profiler``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "replica_all_reduce")
LINKS = ("intra_node", "inter_node")  # bytes this rank sent, by where the receiver sits (core/transport/topology.py)


@dataclass(slots=True)
class StepRecord:
    wall_s: float
    blocked_s: dict[str, float]
    bytes_sent: dict[str, int]
    bytes_by_link: dict[str, int]

    @property
    def exposed_s(self) -> float:
        return sum(self.blocked_s.values())

    @property
    def compute_s(self) -> float:
        return max(0.0, self.wall_s - self.exposed_s)


class CommunicationProfiler(Callback):
    """Measures every training batch of a ZeroStrategy run (see the module docstring)."""

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.records: list[StepRecord] = []
        self._start = 0.0
        self._bytes: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._links: dict[str, int] = {}

    @staticmethod
    def _log(trainer: Trainer) -> Any:
        return trainer.strategy.engine.comm_log  # type: ignore[attr-defined]

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        log = self._log(trainer)
        self._bytes, self._seconds = dict(log.bytes_by_kind), dict(log.seconds_by_kind)
        self._links = dict(log.bytes_by_link)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The optimizer step (and stage 1's reduction) runs inside this batch's closure, so it is included.
        wall = time.perf_counter() - self._start
        log = self._log(trainer)
        record = StepRecord(
            wall_s=wall,
            blocked_s={k: log.seconds_by_kind.get(k, 0.0) - self._seconds.get(k, 0.0) for k in KINDS},
            bytes_sent={k: log.bytes_by_kind.get(k, 0) - self._bytes.get(k, 0) for k in KINDS},
            bytes_by_link={k: log.bytes_by_link.get(k, 0) - self._links.get(k, 0) for k in LINKS},
        )
        self.records.append(record)
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50)
        if trainer.is_global_zero and trainer.loggers and len(self.records) % max(1, every) == 0:
            metrics = {"comm/step_s": record.wall_s, "comm/compute_s": record.compute_s,
                       "comm/exposed_s": record.exposed_s}
            for kind in KINDS:
                metrics[f"comm/{kind}_bytes"] = float(record.bytes_sent[kind])
                metrics[f"comm/{kind}_blocked_s"] = record.blocked_s[kind]
            for link in LINKS:
                metrics[f"comm/{link}_bytes_sent"] = float(record.bytes_by_link[link])
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and self.records:
            rank_zero_info(self.summary(trainer))

    def summary(self, trainer: Trainer | None = None) -> str:
        """A table of per-step means over the measured steps, with the topology."""
        steps = self.records[1:] or self.records  # the first step includes warm-up
        count = len(steps)
        wall = sum(r.wall_s for r in steps) / count
        exposed = sum(r.exposed_s for r in steps) / count
        topology = ""
        if trainer is not None:
            backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
            topology = f"world size {trainer.world_size}, nodes {trainer.num_nodes}, backend {backend}; "
        lines = [
            f"ZeRO communication profile: {topology}{count} steps, mean step {wall * 1000:.1f} ms "
            f"(compute {(wall - exposed) * 1000:.1f} ms, communication not hidden {exposed * 1000:.1f} ms)",
            "| collective | MiB / step | blocked ms / step | MB/s while blocked |",
            "|---|---|---|---|",
        ]
        for kind in KINDS:
            sent = sum(r.bytes_sent[kind] for r in steps) / count
            blocked = sum(r.blocked_s[kind] for r in steps) / count
            rate = f"{sent / blocked / 1e6:.0f}" if blocked > 0 else "-"
            lines.append(f"| {kind} | {sent / 2**20:.2f} | {blocked * 1000:.1f} | {rate} |")
        links = ", ".join(f"{link} {sum(r.bytes_by_link[link] for r in steps) / count / 2**20:.2f}" for link in LINKS)
        lines.append(f"MiB sent by this rank per step, by link: {links}")
        return "\n".join(lines)
