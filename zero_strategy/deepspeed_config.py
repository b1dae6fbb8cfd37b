"""Import a DeepSpeed JSON config: ``parse_deepspeed_config("ds_config.json")`` → :class:`DeepSpeedImport`.

It yields keyword arguments for ZeroConfig, ZeroPrecision and the Trainer, and a :class:`BatchRule`. Each key is
mapped, or matches our fixed behaviour (accepted), or is "auto" (``DeepSpeedImport.auto`` says what decides it), or
is reported with the reason it has no counterpart — all reported keys in one warning.

[Note: nearest knobs] Keys map by meaning, not by name. ``stage3_prefetch_bucket_size`` > 0 → ``prefetch`` (we
prefetch one unit ahead; the size has no counterpart). ``reduce_bucket_size`` (else ``allgather_bucket_size``) →
``min_unit_numel`` at stages 1/2 only, where a unit is just the bucket that is reduce-scattered and all-gathered; at
stage 3 a unit is also what is gathered whole, so a bucket size would change peak memory: reported. ``sub_group_size``
→ ``nvme_chunk_numel`` with NVMe optimizer offload (elements stepped at a time). ``zero_hpz_partition_size`` > 1
(ZeRO++ hpZ) → ``hierarchical_params`` (the same secondary group size; 1 is DeepSpeed's "off").
``stage3_param_persistence_threshold`` has no counterpart (every parameter is sharded). ``cpu_checkpointing`` is
honoured without ``partition_activations`` (which needs model parallelism). ``pin_memory`` is false, DeepSpeed's
default, when an active offload block omits it.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from zero_strategy.config import OffloadDevice, ZeroConfig, ZeroConfigError
from zero_strategy.core.stage import ZeroStage
from zero_strategy.core.step.loss_scaler import LossScalerConfig
from zero_strategy.deepspeed_known_keys import ANY_VALUE as _ANY
from zero_strategy.deepspeed_known_keys import KNOWN_KEYS as _KNOWN
from zero_strategy.deepspeed_known_keys import NO_COUNTERPART as _UNKNOWN
from zero_strategy.deepspeed_known_keys import NO_VALUE as _NONE
from zero_strategy.deepspeed_known_keys import ZERO_PREFIX as _Z

AUTO = "auto"  # what Hugging Face writes for "fill this in from the training arguments"
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
LOSS_SCALE_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                   "min_loss_scale")
_INTEGER_KEYS = ("initial_scale_power", "loss_scale_window", "hysteresis")
REDUCE_DTYPES = ("fp32", "fp16", "bf16")
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BATCH_RULE = "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot be imported: the message names the file, the key and the fix."""


class UnmappedDeepSpeedKeysWarning(UserWarning):
    """Keys of an imported DeepSpeed config that have no counterpart here (all listed in one warning)."""


def _default(cls: type, name: str) -> Any:  # read from the class, so that messages never go stale
    return next(f.default for f in fields(cls) if f.name == name)


def _positive(source: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeepSpeedConfigError(f"{source}: {name}={value!r} must be a positive integer")
    return value


@dataclass(kw_only=True, slots=True)
class ResolvedBatch:
    """The four batch numbers after a successful check."""

    train_batch_size: int
    """Samples per optimizer step over all ranks: the product of the other three."""
    micro_batch_size: int
    """Samples per rank per forward/backward (the DataLoader's batch_size)."""
    accumulate_grad_batches: int
    """Micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps)."""
    world_size: int
    """Data-parallel ranks."""


@dataclass(kw_only=True, slots=True)
class BatchRule:
    """The batch keys of a DeepSpeed config, checked against the world size and then against the Trainer.

    A key that is missing or "auto" is None here and :meth:`resolve` fills it from the Trainer; a given key must
    agree with it. Given one key, DeepSpeed assumes ``gradient_accumulation_steps = 1``; we let
    ``Trainer(accumulate_grad_batches)`` decide instead, as Lightning's DeepSpeed integration does.
    """

    train_batch_size: int | None = None
    """``train_batch_size`` (None: missing or "auto")."""
    micro_batch_size: int | None = None
    """``train_micro_batch_size_per_gpu`` (None: missing or "auto")."""
    gradient_accumulation_steps: int | None = None
    """``gradient_accumulation_steps`` (None: missing or "auto")."""
    source: str = "<dict>"
    """The config file, for messages."""

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) is not None:
                _positive(self.source, f"BatchRule.{name}", getattr(self, name))

    def _origin(self, index: int) -> str:
        return f'{self.source} "{BATCH_KEYS[index]}"'

    def infer(self, world_size: int) -> ResolvedBatch | None:
        """Check with only the world size known, inferring one open key as DeepSpeed does (floor division);
        None when two keys are open (the Trainer fills them in :meth:`resolve`)."""
        _positive(self.source, "world_size", world_size)
        tb, mb, ga = self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps
        if sum(value is None for value in (tb, mb, ga)) > 1:
            return None
        origins = [self._origin(i) for i in range(3)] + ["the world_size argument"]
        if ga is None:
            assert tb is not None and mb is not None
            ga, origins[2] = tb // mb // world_size, "inferred as DeepSpeed does: train // micro // world"
        elif mb is None:
            assert tb is not None
            mb, origins[1] = tb // world_size // ga, "inferred as DeepSpeed does: train // world // accumulation"
        elif tb is None:
            tb, origins[0] = mb * ga * world_size, "inferred: micro * accumulation * world"
        _raise_if_mismatch(self.source, list(zip((tb, mb, ga, world_size), origins, strict=True)), [])
        return ResolvedBatch(train_batch_size=tb, micro_batch_size=mb, accumulate_grad_batches=ga,
                             world_size=world_size)

    def resolve(self, world_size: int, micro_batch: int, accumulate: int) -> ResolvedBatch:
        """Check against the Trainer (world size, DataLoader batch_size, accumulate_grad_batches), which fill gaps."""
        for name, value in (("world_size", world_size), ("micro_batch", micro_batch), ("accumulate", accumulate)):
            _positive(self.source, name, value)
        conflicts = [f"{self._origin(i)} is {given}, not {actual}" for i, given, actual in (
            (1, self.micro_batch_size, micro_batch), (2, self.gradient_accumulation_steps, accumulate))
            if given is not None and given != actual]
        product = micro_batch * accumulate * world_size
        train = (product, "micro * accumulation * world") if self.train_batch_size is None else (
            self.train_batch_size, self._origin(0))
        rows = [train, (micro_batch, "the DataLoader's batch_size"), (accumulate, "Trainer(accumulate_grad_batches)"),
                (world_size, "the Trainer: devices * num_nodes")]
        _raise_if_mismatch(self.source, rows, conflicts)
        return ResolvedBatch(train_batch_size=product, micro_batch_size=micro_batch,
                             accumulate_grad_batches=accumulate, world_size=world_size)


def _raise_if_mismatch(source: str, rows: list[tuple[int, str]], conflicts: list[str]) -> None:
    """Raise showing all four numbers (train, micro, accumulation, world) and where each came from."""
    (train, _), (micro, _), (accum, _), (world, _) = rows
    product = micro * accum * world
    if not conflicts and train == product:
        return
    lines = [f"  {name} = {value}  (from {origin})" for name, (value, origin) in
             zip((*BATCH_KEYS, "world_size"), rows, strict=True)]
    verdict = f"  {micro} * {accum} * {world} = {product}" + (f", not {train}" if train != product else "")
    raise DeepSpeedConfigError(
        f"{source}: the batch sizes disagree. DeepSpeed requires {_BATCH_RULE}; here\n" + "\n".join(lines) + "\n"
        + verdict + "".join(f"\n  and {conflict}" for conflict in conflicts)
        + '\nMake the config and the Trainer/DataLoader agree, or write "auto" to take the Trainer\'s values.'
    )


@dataclass(kw_only=True, slots=True)
class DeepSpeedImport:
    """What a DeepSpeed config means here: ``ZeroStrategy(**result.zero_config_kwargs())``,
    ``ZeroPrecision(result.precision, **result.precision_kwargs)``, ``Trainer(gradient_clip_val=...)``."""

    source: str = "<dict>"
    """The config file (``"<dict>"`` for a mapping)."""
    zero_options: dict[str, Any] = field(default_factory=dict)
    """ZeroConfig keyword arguments, only those the config sets."""
    precision: str = "32-true"
    """"32-true", "16-mixed" or "bf16-mixed" ("32-true" too when the enabled flags are "auto": see ``auto``)."""
    precision_kwargs: dict[str, Any] = field(default_factory=dict)
    """ZeroPrecision keyword arguments: the fp16 loss-scale keys the config sets, and ``reduce_dtype``."""
    gradient_clip_val: float | None = None
    """Clip the global gradient norm to this; None when the config does not clip or leaves it to the Trainer."""
    activation_checkpointing: dict[str, Any] = field(default_factory=dict)
    """ZeroConfig keyword arguments for activation checkpointing (``cpu_checkpointing``). A DeepSpeed config does
    not name the modules to checkpoint: pass ``activation_checkpointing=[class names]`` yourself."""
    batch: BatchRule = field(default_factory=BatchRule)
    """The batch keys; :meth:`BatchRule.resolve` checks them against the Trainer."""
    inferred_batch: ResolvedBatch | None = None
    """The batch numbers checked at parse time (``world_size`` given and at most one key open)."""
    unmapped: list[str] = field(default_factory=list)
    """Dotted keys with no counterpart, reported in one warning."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why each key of ``unmapped`` has no counterpart."""
    auto: dict[str, str] = field(default_factory=dict)
    """Dotted keys written as "auto" → what decides them instead (the Trainer, or which default of ours)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise DeepSpeedConfigError(f"{self.source}: precision={self.precision!r}: use one of {PRECISIONS}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise DeepSpeedConfigError(f"{self.source}: gradient_clip_val={self.gradient_clip_val} must be > 0")

    def zero_config_kwargs(self) -> dict[str, Any]:
        """Everything for ``ZeroConfig(**...)`` / ``ZeroStrategy(**...)``: zero_options + activation_checkpointing."""
        return {**self.zero_options, **self.activation_checkpointing}


@dataclass(kw_only=True, slots=True)
class _Collector:
    """What the section parsers produce while they walk the config."""

    source: str
    zero_options: dict[str, Any] = field(default_factory=dict)
    precision_kwargs: dict[str, Any] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)  # dotted key -> reason
    auto: dict[str, str] = field(default_factory=dict)

    def error(self, key: str, message: str) -> DeepSpeedConfigError:
        return DeepSpeedConfigError(f"{self.source}: {key}: {message}")

    def section(self, block: dict[str, Any], key: str, dotted: str = "") -> dict[str, Any]:
        """Pop a nested object (missing or null: empty)."""
        value = block.pop(key, None)
        if value is not None and not isinstance(value, Mapping):
            raise self.error(dotted or key, f"must be a JSON object, got {value!r}")
        return dict(value or {})

    def take(self, block: dict[str, Any], key: str, dotted: str, instead: str) -> Any:
        """Pop a value; "auto" is recorded with what decides it ``instead`` and read as absent (None)."""
        value = block.pop(key, None)
        if value == AUTO:
            self.auto[dotted] = instead
            return None
        return value

    def number(self, key: str, value: Any, *, integer: bool, minimum: float = 0) -> Any:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (integer and not float(value).is_integer()) or value < minimum:
            raise self.error(key, f'{value!r}: use {"an integer" if integer else "a number"} >= {minimum:g} or "auto"')
        return int(value) if integer else float(value)

    def flag(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f'{value!r} must be true or false (or "auto")')
        return value

    def leftovers(self, prefix: str, block: Mapping[str, Any]) -> None:
        """Keys no parser took: accept the ones that match our fixed behaviour, report the rest."""
        for key, value in block.items():
            dotted = f"{prefix}.{key}" if prefix else key
            fixed, reason = _KNOWN.get(dotted, (_NONE, _UNKNOWN))
            if value is None or fixed is _ANY or (fixed is not _NONE and value == fixed):
                continue  # null means DeepSpeed's default, which changes nothing either
            if value == AUTO:
                self.auto[dotted] = "no counterpart: zero_strategy's own behaviour applies"
            elif not (isinstance(value, Mapping) and (not value or value.get("enabled") is False)):
                self.unmapped[dotted] = reason  # (an empty or disabled block changes nothing)


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


def _parse_precision(cfg: dict[str, Any], c: _Collector) -> str:
    fp16 = c.section(cfg, "fp16")
    bf16_name = "bf16" if cfg.get("bf16") is not None else "bfloat16"  # DeepSpeed still reads the old name
    bf16 = c.section(cfg, bf16_name)
    cfg.pop("bfloat16", None)
    fp16_on, bf16_on = fp16.pop("enabled", False), bf16.pop("enabled", False)
    if fp16_on is True and bf16_on is True:
        raise c.error(f"fp16.enabled and {bf16_name}.enabled", "both are true, but fp16 and bf16 cannot be used at "
                      "once: enable one of them (bf16 needs no loss scaling).")
    precision = "16-mixed" if fp16_on is True else "bf16-mixed" if bf16_on is True else "32-true"
    for name, on in (("fp16", fp16_on), (bf16_name, bf16_on)):
        if on != AUTO:
            c.flag(f"{name}.enabled", on)
        else:
            c.auto[f"{name}.enabled"] = (f"Trainer(precision=...); imported as {precision!r} (ZeroPrecision's "
                                         "default '32-true' when the config enables neither)")
    for key in LOSS_SCALE_KEYS:  # inert while fp16 is off (in DeepSpeed too); kept for "auto": the Trainer may pick it
        value = None if fp16_on is False else c.take(
            fp16, key, f"fp16.{key}", f"ZeroPrecision default {key}={_default(LossScalerConfig, key)!r}")
        fp16.pop(key, None)
        if value is not None and key == "consecutive_hysteresis":
            c.precision_kwargs[key] = c.flag(f"fp16.{key}", value)
        elif value is not None:
            c.precision_kwargs[key] = c.number(f"fp16.{key}", value, integer=key in _INTEGER_KEYS)
    c.leftovers("fp16", fp16)
    c.leftovers("bf16", bf16)
    return precision


def _parse_zero(cfg: dict[str, Any], c: _Collector) -> None:
    raw = cfg.pop("zero_optimization", None)
    if isinstance(raw, bool):  # DeepSpeed's deprecated form: true = stage 1
        raw = {"stage": int(raw)}
    block = c.section({"zero_optimization": raw}, "zero_optimization")
    raw = c.take(block, "stage", _Z + "stage", "the stage given to ZeroStrategy (strategy name or stage=)")
    number = None if raw is None else c.number(_Z + "stage", raw, integer=True)
    if number is not None and number not in tuple(ZeroStage):
        raise c.error(_Z + "stage", f"{number}: use 1, 2 or 3" + (
            " (0 turns ZeRO off: that is Trainer(strategy='ddp'))" if number == 0 else ""))
    stage = None if number is None else ZeroStage(number)
    c.zero_options.update({} if number is None else {"stage": number})
    _parse_offload(block, c, stage)
    _parse_buckets(block, c, stage)
    c.leftovers("zero_optimization", block)


def _parse_offload(block: dict[str, Any], c: _Collector, stage: ZeroStage | None) -> None:
    """offload_optimizer / offload_param → devices, nvme_path, pin_memory."""
    pins: list[bool] = []
    paths: list[tuple[str, str]] = []
    for kind in ("offload_optimizer", "offload_param"):
        prefix = _Z + kind
        sub = c.section(block, kind, prefix)
        device = c.take(sub, "device", f"{prefix}.device", f"ZeroConfig default {kind}='none'") or "none"
        if device not in {d.value for d in OffloadDevice}:
            raise c.error(f"{prefix}.device", f"{device!r}: use 'none', 'cpu' or 'nvme'.")
        path = sub.pop("nvme_path", None)
        pin = c.take(sub, "pin_memory", f"{prefix}.pin_memory", "DeepSpeed's default: not pinned")
        if device != "none" and kind == "offload_param" and stage is not None and not stage.reshards_parameters:
            c.unmapped[f"{prefix}.device"] = "parameters are offloaded only at stage 3 (DeepSpeed ignores it too)"
        elif device != "none":
            c.zero_options[kind] = device
            pins.append(False if pin is None else c.flag(f"{prefix}.pin_memory", pin))
            if device == "nvme" and path not in (None, AUTO):
                paths.append((f"{prefix}.nvme_path", str(path)))
        c.leftovers(prefix, sub)
    if pins:  # one flag for every host buffer: pinned if any active block asks
        c.zero_options["pin_memory"] = any(pins)
    for key, path in paths[1:]:
        if path != paths[0][1]:
            c.unmapped[key] = f"one nvme_path serves both offloads: {paths[0][1]!r} from {paths[0][0]}"
    c.zero_options.update({"nvme_path": paths[0][1]} if paths else {})


def _parse_buckets(block: dict[str, Any], c: _Collector, stage: ZeroStage | None) -> None:
    """Prefetch, bucket and sub-group sizes onto the nearest ZeroConfig knob (see the note at the top)."""
    prefetch = c.take(block, "stage3_prefetch_bucket_size", _Z + "stage3_prefetch_bucket_size",
                      f"ZeroConfig default prefetch={_default(ZeroConfig, 'prefetch')}")
    if prefetch is not None:
        c.zero_options["prefetch"] = c.number(_Z + "stage3_prefetch_bucket_size", prefetch, integer=True) > 0
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        value = c.take(block, key, _Z + key, f"ZeroConfig default min_unit_numel="
                                             f"{_default(ZeroConfig, 'min_unit_numel')}")
        if value is None:
            continue
        numel, taken = c.number(_Z + key, value, integer=True), c.zero_options.get("min_unit_numel")
        if stage is None or stage.reshards_parameters:
            c.unmapped[_Z + key] = ("a stage-3 unit is also gathered whole: set min_unit_numel / unit_modules" if stage
                                    else "maps to min_unit_numel at stages 1/2, and no stage is set")
        elif numel < 1 or (taken is not None and taken != numel):
            c.unmapped[_Z + key] = "min_unit_numel is one positive size for reduce-scatter and all-gather alike"
        else:
            c.zero_options["min_unit_numel"] = numel
    value = c.take(block, "sub_group_size", _Z + "sub_group_size",
                   f"ZeroConfig default nvme_chunk_numel={_default(ZeroConfig, 'nvme_chunk_numel')}")
    if value is not None:
        numel = c.number(_Z + "sub_group_size", value, integer=True)
        if c.zero_options.get("offload_optimizer") == "nvme" and numel >= 1024:
            c.zero_options["nvme_chunk_numel"] = numel
        else:
            c.unmapped[_Z + "sub_group_size"] = "only NVMe optimizer offload steps in chunks (nvme_chunk_numel >= 1024)"
    hpz = c.take(block, "zero_hpz_partition_size", _Z + "zero_hpz_partition_size", "hierarchical_params=None (off)")
    size = 1 if hpz is None else c.number(_Z + "zero_hpz_partition_size", hpz, integer=True, minimum=1)
    if size > 1 and (stage is None or stage.reshards_parameters):  # ZeRO++ hpZ's secondary group of `size` ranks
        c.zero_options["hierarchical_params"] = size
    elif size > 1:
        c.unmapped[_Z + "zero_hpz_partition_size"] = "hierarchical partitioning (hierarchical_params) is stage 3 only"


def _parse_rest(cfg: dict[str, Any], c: _Collector) -> tuple[dict[str, Any], float | None]:
    """activation_checkpointing, gradient_clipping, zero_allow_untested_optimizer, communication_data_type."""
    block, checkpointing = c.section(cfg, "activation_checkpointing"), {}
    cpu = c.take(block, "cpu_checkpointing", "activation_checkpointing.cpu_checkpointing",
                 f"ZeroConfig default cpu_checkpointing={_default(ZeroConfig, 'cpu_checkpointing')}")
    if cpu is not None:  # DeepSpeed names no modules to checkpoint: the user adds activation_checkpointing=[...]
        checkpointing["cpu_checkpointing"] = c.flag("activation_checkpointing.cpu_checkpointing", cpu)
    c.leftovers("activation_checkpointing", block)
    clip = c.take(cfg, "gradient_clipping", "gradient_clipping", "Trainer(gradient_clip_val=...); none if unset")
    clip = None if clip is None else c.number("gradient_clipping", clip, integer=False) or None  # 0: DeepSpeed's off
    allow = c.take(cfg, "zero_allow_untested_optimizer", "zero_allow_untested_optimizer",
                   "ZeroConfig default allow_untested_optimizer=False")
    if allow is not None:
        c.zero_options["allow_untested_optimizer"] = c.flag("zero_allow_untested_optimizer", allow)
    dtype = c.take(cfg, "communication_data_type", "communication_data_type", "ZeroPrecision default: fp32")
    if dtype is not None and dtype not in REDUCE_DTYPES:
        raise c.error("communication_data_type", f"{dtype!r}: use one of {REDUCE_DTYPES}.")
    c.precision_kwargs.update({} if dtype is None else {"reduce_dtype": dtype})
    c.leftovers("data_types", c.section(cfg, "data_types"))
    return checkpointing, clip


def _parse_batch(cfg: dict[str, Any], c: _Collector) -> BatchRule:
    instead = ("micro * accumulation * world size", "the DataLoader's batch_size", "Trainer(accumulate_grad_batches)")
    numbers: list[int | None] = []
    for key, origin in zip(BATCH_KEYS, instead, strict=True):
        value = c.take(cfg, key, key, f"{origin} (BatchRule.resolve)")
        numbers.append(None if value is None else c.number(key, value, integer=True, minimum=1))
    return BatchRule(train_batch_size=numbers[0], micro_batch_size=numbers[1], gradient_accumulation_steps=numbers[2],
                     source=c.source)


def _validate(c: _Collector, checkpointing: dict[str, Any]) -> None:
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
    c = _Collector(source=source)
    precision = _parse_precision(cfg, c)
    _parse_zero(cfg, c)
    checkpointing, clip = _parse_rest(cfg, c)
    batch = _parse_batch(cfg, c)
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
