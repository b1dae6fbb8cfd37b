"""Pretrained weights read by name and element range, from any kind of file (``checkpoint/pretrained/open.py`` opens
one; ``stores.py`` reads each kind; ``keys.py`` renames and matches names). Imports ``checkpoint/base``,
``checkpoint/sharded`` and ``checkpoint/dcp``.

``zero_strategy.checkpoint.pretrained`` was a module before the checkpoint rooms: its public names stay importable
from here."""

from zero_strategy.checkpoint.pretrained.open import PretrainedSource, load_pretrained, open_pretrained

__all__ = ["PretrainedSource", "load_pretrained", "open_pretrained"]
