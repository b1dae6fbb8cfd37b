"""What the section parsers (sections.py) produce while they walk a DeepSpeed config, and how they read its
values: a nested object, a number, a flag, "auto", and the keys no parser took (known_keys.py says which of those
match zero_strategy's fixed behaviour)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zero_strategy.deepspeed_import.errors import DeepSpeedConfigError
from zero_strategy.deepspeed_import.known_keys import ANY_VALUE as _ANY
from zero_strategy.deepspeed_import.known_keys import KNOWN_KEYS as _KNOWN
from zero_strategy.deepspeed_import.known_keys import NO_COUNTERPART as _UNKNOWN
from zero_strategy.deepspeed_import.known_keys import NO_VALUE as _NONE

AUTO = "auto"  # what Hugging Face writes for "fill this in from the training arguments"


@dataclass(kw_only=True, slots=True)
class KeyCollector:
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
