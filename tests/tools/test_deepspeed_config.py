"""DeepSpeed config import: mapping onto ZeroConfig / ZeroPrecision, "auto", batch arithmetic, unmapped keys, files.

Pure Python and fast. The expected values are DeepSpeed's documented semantics written out by hand; every produced
option set is also fed to the real ZeroConfig / ZeroPrecision, so a mapping they reject fails here.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

import zero_strategy
from zero_strategy.config import ZeroConfig
from zero_strategy.deepspeed_config import (
    BatchRule,
    DeepSpeedConfigError,
    DeepSpeedImport,
    ResolvedBatch,
    UnmappedDeepSpeedKeysWarning,
    parse_deepspeed_config,
)

pytestmark = pytest.mark.timeout(10)

ZERO1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                               "contiguous_gradients": True, "overlap_comm": False, "reduce_scatter": True},
         "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
ZERO2_CPU = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                   "allgather_partitions": True, "reduce_bucket_size": 2e8},
             "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True}
ZERO3_NVME = {
    "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 0, "sub_group_size": 1e8,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False},
    },
    "fp16": {"enabled": True}, "train_batch_size": 64, "activation_checkpointing": {"cpu_checkpointing": True},
}
FP16_ALL = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                     "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 0.5},
            "communication_data_type": "bf16", "zero_optimization": {"stage": 2}}
HF_AUTO = {  # the shape Hugging Face's example configs have
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": "auto"},
                          "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "sub_group_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _parse(config: Any, **kwargs: Any) -> tuple[DeepSpeedImport, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = parse_deepspeed_config(config, **kwargs)
    return result, [w for w in caught if issubclass(w.category, UnmappedDeepSpeedKeysWarning)]


def _quiet(config: Any, **kwargs: Any) -> DeepSpeedImport:
    result, caught = _parse(config, **kwargs)
    assert caught == [], [str(w.message) for w in caught]
    return result


# ----------------------------------------------------------------------------------------------- ZeRO shapes
def test_zero1_buckets_map_to_unit_size():
    result = _quiet(ZERO1)
    assert result.zero_options == {"stage": 1, "min_unit_numel": 500_000_000}
    assert result.precision == "32-true" and result.precision_kwargs == {} and result.gradient_clip_val is None
    assert result.unmapped == []


def test_zero2_cpu_offload_bf16_clipping():
    result = _quiet(ZERO2_CPU)
    assert result.zero_options == {"stage": 2, "offload_optimizer": "cpu", "pin_memory": True,
                                   "min_unit_numel": 200_000_000, "allow_untested_optimizer": True}
    assert result.precision == "bf16-mixed"
    assert result.gradient_clip_val == 1.0


def test_zero3_nvme_offload():
    result, caught = _parse(ZERO3_NVME)
    assert result.zero_options == {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme",
                                   "nvme_path": "/local_nvme", "pin_memory": True, "prefetch": False,
                                   "nvme_chunk_numel": 100_000_000}
    assert result.activation_checkpointing == {"cpu_checkpointing": True}
    assert result.precision == "16-mixed"
    assert result.unmapped == ["zero_optimization.offload_optimizer.buffer_count"]
    assert len(caught) == 1


def test_stage3_bucket_and_persistence_keys_are_reported_not_mapped():
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                                    "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9}}
    result, _ = _parse(config)
    assert result.zero_options == {"stage": 3, "prefetch": True}  # min_unit_numel keeps its default
    assert set(result.unmapped) == {"zero_optimization.reduce_bucket_size",
                                    "zero_optimization.stage3_param_persistence_threshold",
                                    "zero_optimization.stage3_max_live_parameters"}
    assert "gathered whole" in result.reasons["zero_optimization.reduce_bucket_size"]


def test_offload_param_below_stage3_is_inert_and_cpu_sub_group_is_reported():
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu", "pin_memory": True}, "sub_group_size": 1e9}}
    result, caught = _parse(config)
    assert result.zero_options == {"stage": 2, "offload_optimizer": "cpu", "pin_memory": False}  # DeepSpeed default
    assert result.unmapped == ["zero_optimization.offload_param.device", "zero_optimization.sub_group_size"]
    assert len(caught) == 1


def test_hpz_partition_size_maps_to_hierarchical_params():
    """ZeRO++'s ``zero_hpz_partition_size`` (ranks of the secondary group; 1 = off) is hierarchical stage 3."""
    result = _quiet({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert result.zero_options == {"stage": 3, "hierarchical_params": 8}
    assert ZeroConfig(**result.zero_config_kwargs()).hierarchical_params == 8
    assert _quiet({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}).zero_options == {"stage": 3}
    result, caught = _parse({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 4}})
    assert result.zero_options == {"stage": 2} and len(caught) == 1
    assert "stage 3 only" in result.reasons["zero_optimization.zero_hpz_partition_size"]


def test_nvme_paths_that_differ_use_the_optimizer_one():
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                                    "offload_param": {"device": "nvme", "nvme_path": "/b"}}}
    result, _ = _parse(config)
    assert result.zero_options["nvme_path"] == "/a"
    assert result.unmapped == ["zero_optimization.offload_param.nvme_path"]


@pytest.mark.parametrize(("zero", "needle"), [
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "nvme_path"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
     "offload_optimizer"),
    ({"stage": 3, "offload_optimizer": {"device": "hpu"}}, "offload_optimizer.device"),
    ({"stage": 0}, "strategy='ddp'"),
    ({"stage": "three"}, "zero_optimization.stage"),
])
def test_invalid_zero_settings_name_the_key(zero, needle):
    with pytest.raises(DeepSpeedConfigError, match="<dict>") as info:
        parse_deepspeed_config({"zero_optimization": zero})
    assert needle in str(info.value)


# ------------------------------------------------------------------------------------------------ precision
def test_fp16_takes_every_loss_scale_key_and_reduce_dtype():
    result = _quiet(FP16_ALL)
    assert result.precision == "16-mixed"
    assert result.precision_kwargs == {"loss_scale": 0.0, "initial_scale_power": 12, "loss_scale_window": 500,
                                       "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 0.5,
                                       "reduce_dtype": "bf16"}
    plugin = zero_strategy.ZeroPrecision(result.precision, **result.precision_kwargs)
    assert plugin.scaler is not None and plugin.loss_scale == 2.0**12
    assert plugin.scaler.config.hysteresis == 3 and plugin.scaler.config.consecutive_hysteresis is True


@pytest.mark.parametrize("name", ["bf16", "bfloat16"])
def test_bf16_with_inert_fp16_block(name):
    config = {name: {"enabled": True}, "fp16": {"enabled": False, "loss_scale_window": 7, "auto_cast": False}}
    result = _quiet(config)
    assert result.precision == "bf16-mixed" and result.precision_kwargs == {}


def test_fp16_and_bf16_both_enabled_is_an_error():
    with pytest.raises(DeepSpeedConfigError, match=r"fp16\.enabled and bf16\.enabled.*both are true"):
        parse_deepspeed_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_bad_loss_scale_values_are_errors():
    with pytest.raises(DeepSpeedConfigError, match="hysteresis"):
        parse_deepspeed_config({"fp16": {"enabled": True, "hysteresis": 0}})
    with pytest.raises(DeepSpeedConfigError, match=r"fp16\.loss_scale_window"):
        parse_deepspeed_config({"fp16": {"enabled": True, "loss_scale_window": 2.5}})


# --------------------------------------------------------------------------------------------------- "auto"
def test_hugging_face_auto_values_are_recorded_not_reported():
    result = _quiet(HF_AUTO)
    assert result.precision == "32-true"  # both "auto": the Trainer's precision decides
    assert result.zero_options == {"stage": 3, "offload_optimizer": "cpu", "pin_memory": False}
    # the loss-scale keys are kept for a Trainer that picks fp16
    assert result.precision_kwargs == {"loss_scale": 0.0, "loss_scale_window": 1000, "initial_scale_power": 16,
                                       "hysteresis": 2, "min_loss_scale": 1.0}
    assert result.gradient_clip_val is None
    assert "Trainer(precision" in result.auto["fp16.enabled"]
    assert "min_unit_numel=1000000" in result.auto["zero_optimization.reduce_bucket_size"]
    assert "prefetch=True" in result.auto["zero_optimization.stage3_prefetch_bucket_size"]
    assert "gradient_clip_val" in result.auto["gradient_clipping"]
    assert "accumulate_grad_batches" in result.auto["gradient_accumulation_steps"]
    assert "zero_optimization.stage3_param_persistence_threshold" in result.auto
    assert result.batch == BatchRule(source="<dict>")
    assert result.batch.resolve(world_size=4, micro_batch=8, accumulate=2) == ResolvedBatch(
        train_batch_size=64, micro_batch_size=8, accumulate_grad_batches=2, world_size=4)


def test_fp16_auto_with_bf16_true_is_bf16():
    result = _quiet({"fp16": {"enabled": "auto", "initial_scale_power": 10}, "bf16": {"enabled": True}})
    assert result.precision == "bf16-mixed" and result.precision_kwargs == {"initial_scale_power": 10}


def test_gradient_clipping_zero_means_off():
    assert _quiet({"gradient_clipping": 0.0}).gradient_clip_val is None
    assert _quiet({"gradient_clipping": 0.5}).gradient_clip_val == 0.5


# ---------------------------------------------------------------------------------------------------- batch
def test_batch_keys_consistent_with_world_size():
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    result = _quiet(config, world_size=4)
    assert result.inferred_batch == ResolvedBatch(train_batch_size=32, micro_batch_size=4, accumulate_grad_batches=2,
                                                  world_size=4)


def test_batch_keys_inconsistent_show_all_four_numbers():
    config = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(DeepSpeedConfigError) as info:
        parse_deepspeed_config(config, world_size=4)
    message = str(info.value)
    for text in ("train_batch_size = 30", "train_micro_batch_size_per_gpu = 4", "gradient_accumulation_steps = 2",
                 "world_size = 4", "4 * 2 * 4 = 32, not 30", '"train_batch_size"', "world_size argument"):
        assert text in message, message


@pytest.mark.parametrize(("config", "expected"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 4)),    # accumulation inferred
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 8, 2)),       # micro batch inferred
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (24, 4, 3)),  # total inferred
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4},
     (32, 4, 4)),                                                                   # "auto" inferred the same way
])
def test_one_missing_batch_key_is_inferred_as_deepspeed_does(config, expected):
    result = _quiet(config, world_size=2)
    assert result.inferred_batch is not None
    inferred = result.inferred_batch
    assert (inferred.train_batch_size, inferred.micro_batch_size, inferred.accumulate_grad_batches) == expected


def test_inference_that_does_not_divide_is_an_error():
    with pytest.raises(DeepSpeedConfigError, match=r"inferred as DeepSpeed does(.|\n)*3 \* 5 \* 2 = 30, not 32"):
        parse_deepspeed_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3}, world_size=2)


def test_two_open_batch_keys_wait_for_the_trainer():
    result = _quiet({"train_batch_size": 64}, world_size=2)
    assert result.inferred_batch is None
    # DeepSpeed would assume accumulation 1 (micro 32); the Trainer's accumulate_grad_batches decides instead
    assert result.batch.resolve(world_size=2, micro_batch=8, accumulate=4).train_batch_size == 64


def test_resolve_against_trainer_consistent():
    rule = _quiet({"train_batch_size": 48, "gradient_accumulation_steps": 3}).batch
    assert rule.resolve(world_size=2, micro_batch=8, accumulate=3) == ResolvedBatch(
        train_batch_size=48, micro_batch_size=8, accumulate_grad_batches=3, world_size=2)


def test_resolve_against_trainer_inconsistent_shows_all_four_numbers():
    rule = _quiet({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 8}, world_size=2).batch
    with pytest.raises(DeepSpeedConfigError) as info:
        rule.resolve(world_size=4, micro_batch=8, accumulate=3)
    message = str(info.value)
    for text in ("train_batch_size = 48", "train_micro_batch_size_per_gpu = 8", "gradient_accumulation_steps = 3",
                 "world_size = 4", "8 * 3 * 4 = 96, not 48", "Trainer(accumulate_grad_batches)",
                 "DataLoader's batch_size"):
        assert text in message, message


def test_resolve_reports_a_config_key_the_dataloader_contradicts():
    rule = _quiet({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}).batch
    with pytest.raises(DeepSpeedConfigError) as info:
        rule.resolve(world_size=2, micro_batch=16, accumulate=2)
    message = str(info.value)
    assert '"train_micro_batch_size_per_gpu" is 4, not 16' in message
    for text in ("train_batch_size = 64", "= 16", "= 2  (from Trainer", "world_size = 2"):
        assert text in message, message


def test_batch_values_must_be_positive_integers():
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size"):
        parse_deepspeed_config({"train_batch_size": 0})
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps"):
        parse_deepspeed_config({"gradient_accumulation_steps": 1.5})


# ------------------------------------------------------------------------------------------- unmapped keys
def test_unmapped_keys_are_reported_in_one_warning():
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupLR"},
        "steps_per_print": 10, "sparse_attention": {"mode": "fixed"}, "tensorboard": {"enabled": False},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False, "profile": False},
    }
    result, caught = _parse(config)
    expected = ["zero_optimization.overlap_comm", "activation_checkpointing.partition_activations", "optimizer",
                "scheduler", "steps_per_print", "sparse_attention"]
    assert result.unmapped == expected
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("<dict>: 6 DeepSpeed key(s)")
    for key in expected:
        assert f"- {key}: {result.reasons[key]}" in message
    assert "tensorboard" not in message and "contiguous_gradients" not in message  # disabled / our behaviour


# --------------------------------------------------------------------------------------------------- files
def test_json_file_path(tmp_path: Path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**ZERO2_CPU, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}))
    for given in (path, str(path)):
        result = _quiet(given, world_size=2)
        assert result.source == str(path) and result.zero_options["offload_optimizer"] == "cpu"
        assert result.inferred_batch is not None and result.inferred_batch.accumulate_grad_batches == 2
    with pytest.raises(DeepSpeedConfigError, match=r"ds_config\.json"):
        result.batch.resolve(world_size=2, micro_batch=4, accumulate=1)


@pytest.mark.parametrize(("text", "needle"), [
    ('{"fp16": {"enabled": true}', "not valid JSON"),
    ('[{"fp16": {"enabled": true}}]', "JSON object, not a list"),
    ('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}', "duplicate keys ['fp16']"),
    ('{"fp16": 16}', "fp16: must be a JSON object"),
])
def test_bad_files_name_the_file(tmp_path: Path, text, needle):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(DeepSpeedConfigError) as info:
        parse_deepspeed_config(path)
    assert str(path) in str(info.value) and needle in str(info.value)


def test_missing_file_and_wrong_type_name_the_input(tmp_path: Path):
    with pytest.raises(DeepSpeedConfigError, match=r"nope\.json"):
        parse_deepspeed_config(tmp_path / "nope.json")
    with pytest.raises(DeepSpeedConfigError, match="path to a DeepSpeed JSON file or a mapping"):
        parse_deepspeed_config([("fp16", {})])  # type: ignore[arg-type]


# ------------------------------------------------------------------- the outputs fit the real constructors
@pytest.mark.parametrize("config", [ZERO1, ZERO2_CPU, ZERO3_NVME, FP16_ALL, HF_AUTO], ids=[
    "zero1", "zero2_cpu", "zero3_nvme", "fp16_all", "hf_auto"])
def test_outputs_are_accepted_by_zero_config_and_zero_precision(config):
    result, _ = _parse(config)
    built = zero_strategy.ZeroConfig(**result.zero_options)
    for key, value in result.zero_options.items():
        assert getattr(built, key) == value
    zero_strategy.ZeroConfig(**result.zero_config_kwargs())
    strategy = zero_strategy.ZeroStrategy(**result.zero_config_kwargs())
    assert strategy.config.stage == result.zero_options.get("stage", 3)
    plugin = zero_strategy.ZeroPrecision(result.precision, **result.precision_kwargs)
    assert plugin.precision == result.precision


def test_omegaconf_mapping_reads_like_a_dict():
    from omegaconf import OmegaConf

    for config in (HF_AUTO, ZERO3_NVME, FP16_ALL):
        plain, _ = _parse(config)
        hydra, _ = _parse(OmegaConf.create(config))
        assert (hydra.zero_options, hydra.precision, hydra.precision_kwargs, hydra.unmapped, hydra.auto) == (
            plain.zero_options, plain.precision, plain.precision_kwargs, plain.unmapped, plain.auto)
