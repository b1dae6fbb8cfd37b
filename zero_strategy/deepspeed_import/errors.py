"""The error and the warning of a DeepSpeed config import."""

from __future__ import annotations


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot be imported: the message names the file, the key and the fix."""


class UnmappedDeepSpeedKeysWarning(UserWarning):
    """Keys of an imported DeepSpeed config that have no counterpart here (all listed in one warning)."""
