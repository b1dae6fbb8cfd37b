"""Old import path of ``zero_strategy.checkpoint.export.hf_export`` (where the Hugging Face export lives now); kept
so that code importing from here keeps working."""

from zero_strategy.checkpoint.export.hf_export import HfExportError, KeyMap, consolidate_hf

__all__ = ["HfExportError", "KeyMap", "consolidate_hf"]
