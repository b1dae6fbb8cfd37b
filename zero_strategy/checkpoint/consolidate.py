"""Old import path of ``zero_strategy.checkpoint.export.consolidate`` (where consolidation lives now); kept so that
code importing from here keeps working."""

from zero_strategy.checkpoint.export.consolidate import (
    ACCEPTED_SUFFIXES,
    LIGHTNING_SUFFIX,
    SAFETENSORS_SUFFIX,
    STATE_DICT_SUFFIXES,
    StateDictEntry,
    TrainerState,
    consolidate,
    read_param_fp32,
    state_dict_entries,
    stream_values,
)

__all__ = [
    "ACCEPTED_SUFFIXES",
    "LIGHTNING_SUFFIX",
    "SAFETENSORS_SUFFIX",
    "STATE_DICT_SUFFIXES",
    "StateDictEntry",
    "TrainerState",
    "consolidate",
    "read_param_fp32",
    "state_dict_entries",
    "stream_values",
]
