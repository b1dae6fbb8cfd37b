"""Importing a DeepSpeed JSON config: ``parse_deepspeed_config("ds_config.json")`` → :class:`DeepSpeedImport`
(parse.py; the sections in sections.py, the batch keys in batch.py, the keys with no counterpart in known_keys.py).

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

from zero_strategy.deepspeed_import.batch import BATCH_KEYS, BatchRule, ResolvedBatch
from zero_strategy.deepspeed_import.collector import AUTO
from zero_strategy.deepspeed_import.errors import DeepSpeedConfigError, UnmappedDeepSpeedKeysWarning
from zero_strategy.deepspeed_import.parse import parse_deepspeed_config
from zero_strategy.deepspeed_import.result import PRECISIONS, DeepSpeedImport
from zero_strategy.deepspeed_import.sections import LOSS_SCALE_KEYS, REDUCE_DTYPES

__all__ = ["AUTO", "BATCH_KEYS", "LOSS_SCALE_KEYS", "PRECISIONS", "REDUCE_DTYPES", "BatchRule", "DeepSpeedConfigError",
           "DeepSpeedImport", "ResolvedBatch", "UnmappedDeepSpeedKeysWarning", "parse_deepspeed_config"]
