"""What the estimator returns: bytes by place (:class:`Placed`), one configuration's per-rank bytes by category
(:class:`MemoryEstimate`), the configurations compared, and the optimizer state per parameter."""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,  # exp_avg + exp_avg_sq
    "adam": 8,
    "sgd": 4,  # momentum_buffer
    "sgd-no-momentum": 0,
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg (momentum or centered=True add 4 each)
}
"""Optimizer state bytes per parameter, with fp32 masters (the state has the masters' dtype)."""


def state_bytes_per_element(optimizer: str) -> int:
    """Bytes of optimizer state per fp32 master element; a clear error for an optimizer the estimator does not know."""
    if optimizer.lower() not in OPTIMIZER_STATE_BYTES:
        known = ", ".join(f"{k} ({v} B/param)" for k, v in OPTIMIZER_STATE_BYTES.items())
        raise ValueError(f"optimizer={optimizer!r} is not known to the estimator; known optimizers: {known}")
    return OPTIMIZER_STATE_BYTES[optimizer.lower()]


# (stage, offload_optimizer, offload_param), cheapest first: no offload before offload, cpu before nvme, lower
# stage before higher (less communication)
CONFIGURATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "none", "none"), (2, "none", "none"), (3, "none", "none"),
    (1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"),
    (1, "nvme", "none"), (2, "nvme", "none"), (3, "nvme", "none"), (3, "nvme", "nvme"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Placed:
    """Bytes on the compute device, in host memory and in offload files ("nvme")."""

    device: int = 0
    host: int = 0
    nvme: int = 0

    def __add__(self, other: Placed) -> Placed:
        return Placed(self.device + other.device, self.host + other.host, self.nvme + other.nvme)

    @property
    def total(self) -> int:
        return self.device + self.host + self.nvme


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Per-rank bytes of one configuration, by category and place (see the module docstring for each rule)."""

    stage: int
    precision: str  # normalized: "32-true", "bf16-mixed" or "16-mixed"
    world_size: int
    offload_optimizer: str  # "none", "cpu" or "nvme"
    offload_param: str
    optimizer: str  # a key of OPTIMIZER_STATE_BYTES
    num_params: int
    parameters: Placed  # compute-dtype copies (stage 3: the units whole at the peak)
    master: Placed  # fp32 slices not aliasing the parameters
    gradients: Placed  # at their peak: end of backward (stage 1: end of the accumulation window)
    optimizer_state: Placed
    communication: Placed  # transient reduce / gather-source buffers of the largest unit
    activations: Placed  # saved for backward by one forward of sample_batch (0 when not measured)
    notes: tuple[str, ...] = ()
    tensor_parallel: int = 1  # K: ZeRO shards over world_size / K ranks, num_params is one TP rank's

    @property
    def categories(self) -> dict[str, Placed]:
        return {
            "parameters": self.parameters, "master": self.master, "gradients": self.gradients,
            "optimizer": self.optimizer_state, "comm": self.communication, "activations": self.activations,
        }  # fmt: skip

    @property
    def total(self) -> Placed:
        return sum(self.categories.values(), Placed())

    @property
    def label(self) -> str:
        offload = (("opt", self.offload_optimizer), ("param", self.offload_param))
        return " ".join([f"zero{self.stage}", *(f"{what}→{where}" for what, where in offload if where != "none")])

    def fits(self, device_memory_bytes: float, host_memory_bytes: float | None = None) -> bool:
        """Whether this rank's device bytes (and host bytes, when a host budget per rank is given) fit."""
        host_ok = host_memory_bytes is None or self.total.host <= host_memory_bytes
        return self.total.device <= device_memory_bytes and host_ok


