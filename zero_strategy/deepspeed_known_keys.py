"""Moved to zero_strategy/deepspeed_import/known_keys.py; this module keeps the old import path working."""

from zero_strategy.deepspeed_import.known_keys import ANY_VALUE, KNOWN_KEYS, NO_COUNTERPART, NO_VALUE, ZERO_PREFIX

__all__ = ["ANY_VALUE", "KNOWN_KEYS", "NO_COUNTERPART", "NO_VALUE", "ZERO_PREFIX"]
