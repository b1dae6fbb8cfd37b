"""CommunicationProfiler: per optimizer step, where the time went and what was sent.

Per step it reports the wall time split three ways: the time this rank was blocked in each collective kind
(communication that was *not* hidden behind compute), the time inside the optimizer's ``step()`` (on this rank's
slices; fused where ZeRO could), and the compute time (the rest: forward, backward and everything else); plus the
bytes per collective kind and the bandwidth they achieved while blocking. It logs through the Trainer's loggers
(TensorBoard, CSV, W&B alike) and prints a summary table with the topology when ``fit`` ends. Switch it on with
``ZeroStrategy(profile=True)`` or add it as a callback.

[Note: what the profiler can say about the compute floor]
The benchmark measures the compute floor directly (a single process on the same batch). A user's run has no such
twin, so the profiler reports the parts it can time: blocked communication and the optimizer step are the part of
the step above forward/backward compute. Only the blocked communication is purely the price of distribution; the
optimizer step is work a single process would do too (on the whole model rather than a 1/N slice). Their sum,
logged as ``comm/above_compute_share`` of the step, is therefore not the benchmark's "time above floor" (which
also counts sharding bookkeeping, such as flattening gradients, that the profiler books as compute, and credits
the smaller optimizer step): it says how much of a step is not forward/backward compute, and which part is which.

On a GPU, NCCL runs on its own stream and collectives return at once: the blocked time is then the host-side time
only, and for kernel-level overlap use ``torch.profiler``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from zero_strategy.core.comm.group import backend_name

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "replica_all_reduce", "barrier")
LINKS = ("intra_node", "inter_node")  # bytes this rank sent, by where the receiver sits (core/plan/topology.py)


@dataclass(slots=True)
class StepRecord:
    wall_s: float
    blocked_s: dict[str, float]
    bytes_sent: dict[str, int]
    optimizer_s: float = 0.0  # inside optimizer.step() (summed over calls: nvme offload steps in chunks)
    bytes_by_link: dict[str, int] = field(default_factory=dict)  # bytes this rank sent per link

    @property
    def exposed_s(self) -> float:
        return sum(self.blocked_s.values())

    @property
    def compute_s(self) -> float:
        """Forward, backward and the rest: neither blocked in a collective nor in the optimizer step."""
        return max(0.0, self.wall_s - self.exposed_s - self.optimizer_s)

    @property
    def above_compute_share(self) -> float:
        """(blocked communication + optimizer step) / wall: see [Note: what the profiler can say about the compute
        floor]."""
        return (self.exposed_s + self.optimizer_s) / self.wall_s if self.wall_s > 0 else 0.0


class CommunicationProfiler(Callback):
    """Measures every training batch of a ZeroStrategy run (see the module docstring)."""

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.records: list[StepRecord] = []
        self._start = 0.0
        self._bytes: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._optimizer_s = 0.0  # total time inside optimizer.step() so far
        self._optimizer_s_at_start = 0.0
        self._step_started = 0.0
        self._handles: list[RemovableHandle] = []
        self._links: dict[str, int] = {}

    @staticmethod
    def _log(trainer: Trainer) -> Any:
        return trainer.strategy.engine.comm_log  # type: ignore[attr-defined]

    def _before_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._step_started = time.perf_counter()

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_s += time.perf_counter() - self._step_started

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # torch's step hooks time the optimizer's own step(), whoever calls it (Lightning, manual optimization,
        # each chunk of an nvme step); registered last, they exclude ZeRO's own pre-step work.
        self._remove_hooks()
        # On a GPU the host does not block on collectives: blocked time is the compute stream's wait, timed with
        # CUDA events (see CommunicationLog.device_timing); reading them once per batch synchronises, which a
        # profiling run accepts (its wall time needs it too).
        self._log(trainer).device_timing = trainer.strategy.engine.comms.streams is not None  # type: ignore[attr-defined]
        for optimizer in trainer.strategy.engine.optimizers:  # type: ignore[attr-defined]
            self._handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hooks()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        log = self._log(trainer)
        self._bytes, self._seconds = dict(log.bytes_by_kind), dict(log.seconds_by_kind)
        self._optimizer_s_at_start = self._optimizer_s
        self._links = dict(log.bytes_by_link)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The optimizer step (and stage 1's reduction) runs inside this batch's closure, so it is included.
        log = self._log(trainer)
        log.settle_device_times()  # on a GPU: waits for this batch's work, so the wall time below is real too
        wall = time.perf_counter() - self._start
        record = StepRecord(
            wall_s=wall,
            blocked_s={k: log.seconds_by_kind.get(k, 0.0) - self._seconds.get(k, 0.0) for k in KINDS},
            bytes_sent={k: log.bytes_by_kind.get(k, 0) - self._bytes.get(k, 0) for k in KINDS},
            optimizer_s=self._optimizer_s - self._optimizer_s_at_start,
            bytes_by_link={k: log.bytes_by_link.get(k, 0) - self._links.get(k, 0) for k in LINKS},
        )
        self.records.append(record)
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50)
        if trainer.is_global_zero and trainer.loggers and len(self.records) % max(1, every) == 0:
            metrics = {"comm/step_s": record.wall_s, "comm/compute_s": record.compute_s,
                       "comm/exposed_s": record.exposed_s, "comm/optimizer_s": record.optimizer_s,
                       "comm/above_compute_share": record.above_compute_share}
            for kind in KINDS:
                metrics[f"comm/{kind}_bytes"] = float(record.bytes_sent[kind])
                metrics[f"comm/{kind}_blocked_s"] = record.blocked_s[kind]
            for link in LINKS:
                metrics[f"comm/{link}_bytes_sent"] = float(record.bytes_by_link[link])
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()
        if trainer.is_global_zero and self.records:
            rank_zero_info(self.summary(trainer))

    def summary(self, trainer: Trainer | None = None) -> str:
        """A table of per-step means over the measured steps, with the topology."""
        steps = self.records[1:] or self.records  # the first step includes warm-up
        count = len(steps)
        wall = sum(r.wall_s for r in steps) / count
        exposed = sum(r.exposed_s for r in steps) / count
        optimizer = sum(r.optimizer_s for r in steps) / count
        topology = ""
        if trainer is not None:
            backend = backend_name()
            topology = f"world size {trainer.world_size}, nodes {trainer.num_nodes}, backend {backend}; "
        lines = [
            f"ZeRO communication profile: {topology}{count} steps, mean step {wall * 1000:.1f} ms "
            f"(forward/backward and other compute {max(0.0, wall - exposed - optimizer) * 1000:.1f} ms, optimizer "
            f"step {optimizer * 1000:.1f} ms, communication not hidden {exposed * 1000:.1f} ms; the last two are "
            f"{(exposed + optimizer) / wall if wall > 0 else 0.0:.1%} of the step)",
            "| collective | MiB / step | blocked ms / step | MB/s while blocked |",
            "|---|---|---|---|",
        ]
        for kind in KINDS:
            sent = sum(r.bytes_sent[kind] for r in steps) / count
            blocked = sum(r.blocked_s[kind] for r in steps) / count
            rate = f"{sent / blocked / 1e6:.0f}" if blocked > 0 else "-"
            lines.append(f"| {kind} | {sent / 2**20:.2f} | {blocked * 1000:.1f} | {rate} |")
        per_link = {link: sum(r.bytes_by_link.get(link, 0) for r in steps) / count for link in LINKS}
        links = ", ".join(f"{link} {sent / 2**20:.2f}" for link, sent in per_link.items())
        lines.append(f"MiB sent by this rank per step, by link: {links}")
        return "\n".join(lines)
