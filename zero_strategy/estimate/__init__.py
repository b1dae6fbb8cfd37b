"""The memory estimator: per-rank bytes of every ZeRO stage and offload before any run, without Lightning.

``estimate_memory`` / ``compare`` / ``smallest_fitting`` are the arithmetic (:mod:`.memory`), ``compare_peaks`` /
``largest_fitting`` the set-up and training peaks and the largest model a machine fits (:mod:`.fit`); the
``zero-estimate`` command (also ``python -m zero_strategy.estimate``) is :mod:`.cli`.
"""

from zero_strategy.estimate.fit import GPTFamily, Machine, compare_peaks, largest_fitting
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
    "GPTFamily",
    "Machine",
    "MemoryEstimate",
    "Placed",
    "compare",
    "compare_peaks",
    "describe_model",
    "estimate_memory",
    "first_fitting",
    "largest_fitting",
    "measure_activation_bytes",
    "smallest_fitting",
]
