"""Moved to zero_strategy/deepspeed_import/ (a package: parse.py, sections.py, batch.py, result.py, ...); this
module keeps the documented import path ``zero_strategy.deepspeed_config`` working with the same public names."""

from zero_strategy.deepspeed_import import (
    AUTO,
    BATCH_KEYS,
    LOSS_SCALE_KEYS,
    PRECISIONS,
    REDUCE_DTYPES,
    BatchRule,
    DeepSpeedConfigError,
    DeepSpeedImport,
    ResolvedBatch,
    UnmappedDeepSpeedKeysWarning,
    parse_deepspeed_config,
)

__all__ = ["AUTO", "BATCH_KEYS", "LOSS_SCALE_KEYS", "PRECISIONS", "REDUCE_DTYPES", "BatchRule", "DeepSpeedConfigError",
           "DeepSpeedImport", "ResolvedBatch", "UnmappedDeepSpeedKeysWarning", "parse_deepspeed_config"]
