"""The memory estimator: per-rank bytes of every ZeRO stage and offload before any run, without Lightning.

``estimate_memory`` / ``compare`` / ``smallest_fitting`` are the arithmetic (:mod:`.memory`); the ``zero-estimate``
command (also ``python -m zero_strategy.estimate``) is :mod:`.cli`.
"""

from zero_strategy.estimate.memory import (
    CONFIGURATIONS,
    OPTIMIZER_STATE_BYTES,
    EstimateOptions,
    MemoryEstimate,
    Placed,
    compare,
    describe_model,
    estimate_memory,
    first_fitting,
    measure_activation_bytes,
    smallest_fitting,
)

__all__ = [
    "CONFIGURATIONS",
    "OPTIMIZER_STATE_BYTES",
    "EstimateOptions",
    "MemoryEstimate",
    "Placed",
    "compare",
    "describe_model",
    "estimate_memory",
    "first_fitting",
    "measure_activation_bytes",
    "smallest_fitting",
]
