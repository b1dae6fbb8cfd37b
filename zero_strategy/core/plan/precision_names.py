"""The precision names a user may write, and the dtypes they stand for: one table for the precision plugin, the
estimator and the DeepSpeed-config import. Plain torch, so that ``zero-estimate`` runs without Lightning."""

from __future__ import annotations

import torch

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
}
"""Lightning's precision names that ZeroStrategy runs, and the dtype each computes in (masters stay fp32)."""

ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true", "fp16": "16-mixed"}

REDUCE_DTYPES: dict[str | None, torch.dtype] = {
    None: torch.float32, "fp32": torch.float32, "32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
}  # fmt: skip
"""Names accepted for the dtype gradients are reduced in (``None``: the default, fp32)."""


def normalize_precision(precision: str | int) -> str:
    """The canonical name (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``) of a precision flag or its alias."""
    name = ALIASES.get(str(precision), str(precision))
    if name in ("16-true", "bf16-true"):
        raise ValueError(
            f"precision={precision!r}: ZeroStrategy keeps fp32 master weights; use "
            f"'{name.replace('-true', '-mixed')}' for the same memory saving with fp32 masters."
        )
    if name not in COMPUTE_DTYPES:
        raise ValueError(
            f"precision={precision!r} is not supported by ZeroStrategy; use one of {sorted(COMPUTE_DTYPES)}."
        )
    return name


def reduce_dtype_named(name: str | None) -> torch.dtype:
    """Gradients are reduced in fp32 unless asked otherwise (half the bytes in bf16, at some accuracy)."""
    if name not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype={name!r}: use 'fp32', 'bf16' or 'fp16'")
    return REDUCE_DTYPES[name]
