"""``parse_deepspeed_config``: read a DeepSpeed config (a JSON file or a mapping), translate each section
(sections.py), validate the result by building the real configs, and report every unmapped key in one warning."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.engine.loss_scaler import LossScalerConfig
from zero_strategy.deepspeed_import.collector import KeyCollector
from zero_strategy.deepspeed_import.errors import DeepSpeedConfigError, UnmappedDeepSpeedKeysWarning
from zero_strategy.deepspeed_import.result import DeepSpeedImport
from zero_strategy.deepspeed_import.sections import (
    LOSS_SCALE_KEYS,
    parse_batch,
    parse_precision,
    parse_rest,
    parse_zero,
)


def _load(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), "<dict>"
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise DeepSpeedConfigError(f"expected a path to a DeepSpeed JSON file or a mapping, got {path_or_dict!r}")
    source = os.fspath(path_or_dict)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):  # DeepSpeed refuses them too; json would silently keep the last one
            raise DeepSpeedConfigError(f"{source}: duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
        return dict(pairs)

    try:
        data = json.loads(Path(source).read_text(encoding="utf-8"), object_pairs_hook=no_duplicates)
    except (OSError, UnicodeDecodeError) as exc:
        raise DeepSpeedConfigError(f"cannot read the DeepSpeed config {source}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(f"{source} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(f"{source}: a DeepSpeed config is a JSON object, not a {type(data).__name__}")
    return data, source


def _validate(c: KeyCollector, checkpointing: dict[str, Any]) -> None:
    """Build the real configs once, so that a bad value fails here, naming the file, not in Trainer.fit."""
    try:
        ZeroConfig(**c.zero_options, **checkpointing)
    except ZeroConfigError as exc:
        raise DeepSpeedConfigError(f"{c.source}: imported ZeRO options {c.zero_options} are invalid: {exc}") from exc
    try:
        LossScalerConfig(**{key: c.precision_kwargs[key] for key in LOSS_SCALE_KEYS if key in c.precision_kwargs})
    except ValueError as exc:
        raise DeepSpeedConfigError(f"{c.source}: fp16 loss scaling: {exc}") from exc


def parse_deepspeed_config(
    path_or_dict: str | os.PathLike[str] | Mapping[str, Any], world_size: int | None = None
) -> DeepSpeedImport:
    """Read a DeepSpeed config (a JSON file or a loaded mapping) and translate it.

    With ``world_size`` the batch keys are checked at once (one open key inferred as DeepSpeed does); later
    :meth:`BatchRule.resolve` checks them against the Trainer. Unmapped keys: one UnmappedDeepSpeedKeysWarning.
    Raises DeepSpeedConfigError for an unreadable file, fp16+bf16, stage 0, disagreeing batch sizes, bad values.
    """
    cfg, source = _load(path_or_dict)
    c = KeyCollector(source=source)
    precision = parse_precision(cfg, c)
    parse_zero(cfg, c)
    checkpointing, clip = parse_rest(cfg, c)
    batch = parse_batch(cfg, c)
    c.leftovers("", cfg)
    _validate(c, checkpointing)
    result = DeepSpeedImport(
        source=source, zero_options=c.zero_options, precision=precision, precision_kwargs=c.precision_kwargs,
        gradient_clip_val=clip, activation_checkpointing=checkpointing, batch=batch, unmapped=list(c.unmapped),
        reasons=dict(c.unmapped), auto=c.auto,
    )
    if world_size is not None:
        result.inferred_batch = batch.infer(world_size)
    if result.unmapped:
        lines = [f"  - {key}: {reason}" for key, reason in result.reasons.items()]
        head = f"{source}: {len(lines)} DeepSpeed key(s) have no counterpart in zero_strategy and are ignored:"
        warnings.warn("\n".join([head, *lines]), UnmappedDeepSpeedKeysWarning, stacklevel=2)
    return result
