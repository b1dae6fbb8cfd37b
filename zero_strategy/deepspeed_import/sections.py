"""The sections of a DeepSpeed config, each onto the nearest ZeroConfig / ZeroPrecision / Trainer setting (see
[Note: nearest knobs] in deepspeed_import/__init__.py): precision and fp16 loss scaling, ``zero_optimization``
(stage, offload, buckets), activation checkpointing, clipping and communication dtype, the batch keys."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from zero_strategy.config import OffloadDevice, ZeroConfig
from zero_strategy.core.engine.loss_scaler import LossScalerConfig
from zero_strategy.core.stage import ZeroStage
from zero_strategy.deepspeed_import.batch import BATCH_KEYS, BatchRule
from zero_strategy.deepspeed_import.collector import AUTO, KeyCollector
from zero_strategy.deepspeed_import.known_keys import ZERO_PREFIX as _Z

LOSS_SCALE_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                   "min_loss_scale")
_INTEGER_KEYS = ("initial_scale_power", "loss_scale_window", "hysteresis")
REDUCE_DTYPES = ("fp32", "fp16", "bf16")


def _default(cls: type, name: str) -> Any:  # read from the class, so that messages never go stale
    return next(f.default for f in fields(cls) if f.name == name)


def parse_precision(cfg: dict[str, Any], c: KeyCollector) -> str:
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


def parse_zero(cfg: dict[str, Any], c: KeyCollector) -> None:
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


def _parse_offload(block: dict[str, Any], c: KeyCollector, stage: ZeroStage | None) -> None:
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


def _parse_buckets(block: dict[str, Any], c: KeyCollector, stage: ZeroStage | None) -> None:
    """Prefetch, bucket and sub-group sizes onto the nearest ZeroConfig knob (see [Note: nearest knobs] in
    deepspeed_import/__init__.py)."""
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


def parse_rest(cfg: dict[str, Any], c: KeyCollector) -> tuple[dict[str, Any], float | None]:
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


def parse_batch(cfg: dict[str, Any], c: KeyCollector) -> BatchRule:
    instead = ("micro * accumulation * world size", "the DataLoader's batch_size", "Trainer(accumulate_grad_batches)")
    numbers: list[int | None] = []
    for key, origin in zip(BATCH_KEYS, instead, strict=True):
        value = c.take(cfg, key, key, f"{origin} (BatchRule.resolve)")
        numbers.append(None if value is None else c.number(key, value, integer=True, minimum=1))
    return BatchRule(train_batch_size=numbers[0], micro_batch_size=numbers[1], gradient_accumulation_steps=numbers[2],
                     source=c.source)
