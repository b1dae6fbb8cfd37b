"""The DeepSpeed config keys that map onto no ZeroConfig option: each with the value that is zero_strategy's fixed
behaviour (accepted silently) and why any other value is ignored (reported by the import's one warning)."""

from __future__ import annotations

from typing import Any

_ANY = object()  # every value of the key agrees with what zero_strategy always does
_NONE = object()  # no value does: the key is always reported
_NVME_IO = "NVMe offload reads and writes plain files, nvme_chunk_numel elements at a time"
_FP32 = "master weights, gradients and optimizer state are always fp32"
_LOGGER = "use a Lightning logger or profiler"
_UNKNOWN = "no counterpart in zero_strategy"
_Z = "zero_optimization."
# Keys not mapped onto an option: (the value that is our fixed behaviour, why any other value is ignored).
_KNOWN: dict[str, tuple[Any, str]] = {
    _Z + "contiguous_gradients": (True, "gradients always go to one flat buffer per unit"),
    _Z + "reduce_scatter": (True, "gradients are always reduce-scattered (no all-reduce mode)"),
    _Z + "allgather_partitions": (True, "updated parameters are always all-gathered (no broadcast mode)"),
    _Z + "overlap_comm": (False, "a unit's gradients are reduce-scattered when its last one lands, not on a side "
                                 "stream; stage-3 gathers overlap compute through prefetch"),
    _Z + "ignore_unused_parameters": (True, "unused parameters are always tolerated"),
    _Z + "load_from_fp32_weights": (True, "checkpoints always restore the fp32 master weights"),
    **{_Z + f"zero_quantized_{key}": (False, "communication is not quantized")
       for key in ("weights", "nontrainable_weights", "gradients")},
    _Z + "round_robin_gradients": (False, _UNKNOWN),
    # any value is fine: DeepSpeed-internal choices (fp16.auto_cast: our forward always runs under autocast)
    **{key: (_ANY, "") for key in ("fp16.auto_cast", "bf16.immediate_grad_update", "zero_force_ds_cpu_optimizer", *(
        _Z + k for k in ("elastic_checkpoint", "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
                         "override_module_apply")))},
    **{_Z + f"stage3_{key}": (_NONE, "a stage-3 unit is freed right after use; choose units with unit_modules / "
                                     "min_unit_numel") for key in ("max_live_parameters", "max_reuse_distance")},
    **{_Z + f"stage3_{key}_persistence_threshold": (_NONE, "every parameter is sharded (no keep-whole threshold)")
       for key in ("param", "model")},
    **{_Z + f"stage3_gather_{bits}_weights_on_model_save": (False, "checkpoints stay sharded: use zero-to-fp32")
       for bits in ("16bit", "fp16")},
    _Z + "offload_optimizer.ratio": (1.0, "the optimizer state is offloaded whole"),
    **{_Z + key: (False, "deprecated in DeepSpeed: write offload_optimizer / offload_param")
       for key in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")},
    **{f"{_Z}offload_{what}.{key}": (fixed, _NVME_IO) for what in ("optimizer", "param") for key, fixed in (
        ("buffer_count", _NONE), ("buffer_size", _NONE), ("max_in_cpu", _NONE), ("pipeline_read", False),
        ("pipeline_write", False), ("fast_init", False))},
    "bf16.check_grad_overflow": (False, "only fp16 checks gradients for inf/NaN (through the loss scaler)"),
    **{key: (False, _FP32) for key in ("fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads",
                                       "bf16.bf16_optimizer_states")},
    "activation_checkpointing.partition_activations": (False, "no model parallelism to partition activations "
                                                              "across; cpu_checkpointing is imported on its own"),
    "activation_checkpointing.contiguous_memory_optimization": (False, "torch checkpointing manages its buffers"),
    "activation_checkpointing.number_checkpoints": (_NONE, "torch checkpointing manages its buffers"),
    "activation_checkpointing.synchronize_checkpoint_boundary": (False, _UNKNOWN),
    "activation_checkpointing.profile": (False, _LOGGER),
    "data_types.grad_accum_dtype": ("fp32", "gradients are accumulated in fp32"),
    "fp32_allreduce": (True, "gradients are reduced in fp32 unless communication_data_type says otherwise"),
    "gradient_predivide_factor": (1.0, _UNKNOWN),
    **{key: (False, _UNKNOWN) for key in ("prescale_gradients", "sparse_gradients")},
    **{key: (_NONE, "optimizer and LR scheduler come from configure_optimizers") for key in ("optimizer", "scheduler")},
    "steps_per_print": (_NONE, "use Trainer(log_every_n_steps=...)"),
    "amp": (_NONE, "use Trainer(precision='16-mixed' or 'bf16-mixed')"),
    "aio": (_NONE, _NVME_IO),
    "checkpoint": (_NONE, "checkpoints are written by ShardedCheckpointIO"),
    **{key: (False, _LOGGER) for key in ("wall_clock_breakdown", "memory_breakdown", "dump_state")},
    **{key: (_NONE, _LOGGER) for key in ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler")},
}

# what collector.py and sections.py read
ANY_VALUE, NO_VALUE, NO_COUNTERPART, ZERO_PREFIX, KNOWN_KEYS = _ANY, _NONE, _UNKNOWN, _Z, _KNOWN
