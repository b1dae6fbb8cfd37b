"""What a Hugging Face model directory holds, decided before any tensor is read: which state_dict keys are written
under which names (:class:`KeyMap`, tied keys), the shard size (``"5GB"``-style strings), which file each tensor
goes to, and the ``config.json`` text. ``hf_export.py`` writes what is decided here.

[Note: Hugging Face tied weights]
A tied parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) appears in the module's state_dict under
each of its keys, and the checkpoint manifest records that they are one parameter. ``save_pretrained`` writes it
once, under the key transformers ties *from* (the input embedding), because safetensors cannot alias two names to
one buffer; ``from_pretrained`` then re-ties the head and does not report it missing. Checked with GPT-2 on
transformers 5.24: a file with the embedding only, with the head only, or with both (equal) loads with no missing
or unexpected key; transformers 4 re-ties only from the embedding, so the one kept is the embedding. Rule here: of
the keys sharing one parameter, the first one written (state_dict order: Hugging Face models register their
embeddings before their heads) is kept and the others are left out, the layout ``save_pretrained`` writes. When the
config says ``"tie_word_embeddings": false`` the model built from it has separate tensors and needs every key, so
each alias is written (the same values under each name).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""transformers 4's default (transformers 5 moved to 50GB); a 5 GB file is still practical to upload and download."""
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MISSING_CONFIG = (
    "a Hugging Face model directory needs config.json (from_pretrained builds the model from it before loading "
    "any weight): pass the config of the model you trained — zero-to-fp32 --hf-config PATH (a config.json, or "
    "the directory holding it, e.g. where save_pretrained or the Hub download put it), or in Python "
    "config=model.config (a PretrainedConfig), a dict, or that path. For the weights alone, write one file "
    "instead: zero-to-fp32 CHECKPOINT model.safetensors"
)


class HfExportError(ValueError):
    """A Hugging Face export was asked for with inputs it cannot honour (the message says which and how to fix)."""


class JsonConfig(Protocol):
    """What is used of a ``transformers.PretrainedConfig`` (duck-typed: this package does not need transformers)."""

    def to_json_string(self) -> str: ...


ConfigSource = str | os.PathLike | Mapping[str, Any] | JsonConfig


# ------------------------------------------------------------------------------------------------ key names
@dataclass(kw_only=True, slots=True)
class KeyMap:
    """How the LightningModule's state_dict keys become the Hugging Face model's. Applied to each key in this
    order: a key starting with one of ``drop`` is left out; ``strip_prefix`` is removed (a key without it is an
    error naming it, so nothing is left out silently); the longest matching prefix of ``rename`` is replaced."""

    strip_prefix: str = ""
    """The attribute path of the Hugging Face model inside the LightningModule, with its dot: ``"model."`` for
    ``self.model = AutoModelForCausalLM.from_config(...)``."""
    rename: dict[str, str] = field(default_factory=dict)
    """Prefix replacements after stripping, e.g. ``{"backbone.": "transformer.", "head.": "lm_head."}``; end a
    prefix with a dot to match whole attribute names."""
    drop: tuple[str, ...] = ()
    """Prefixes of keys that are not part of the Hugging Face model (a loss module's buffer, a value head)."""

    def __post_init__(self) -> None:
        if any(not old for old in self.rename):
            raise HfExportError("KeyMap.rename: an empty prefix would match every key; name the prefix to replace")
        if any(not prefix for prefix in self.drop):
            raise HfExportError("KeyMap.drop: an empty prefix would drop every key; name the prefix to leave out")
        self.drop = tuple(self.drop)

    def output_names(self, keys: list[str]) -> dict[str, str]:
        """{state_dict key: name written} for every key not dropped; raises when a key lies outside
        ``strip_prefix``."""
        outside: list[str] = []
        names: dict[str, str] = {}
        for key in keys:
            if key.startswith(self.drop):
                continue
            if not key.startswith(self.strip_prefix):
                outside.append(key)
                continue
            name = key[len(self.strip_prefix) :]
            matches = [old for old in self.rename if name.startswith(old)]
            if matches:
                old = max(matches, key=len)
                name = self.rename[old] + name[len(old) :]
            names[key] = name
        if outside:
            first = sorted({key.split(".")[0] + "." for key in outside})
            if not names:  # a wrong prefix, not a few extra modules: say what the keys do start with
                raise HfExportError(
                    f"no state_dict key starts with the prefix {self.strip_prefix!r} to strip; they start with "
                    f"{', '.join(repr(p) for p in first)} (e.g. {outside[0]!r})"
                )
            raise HfExportError(
                f"{len(outside)} state_dict key(s) do not start with the prefix {self.strip_prefix!r} to strip: "
                f"{_listing(outside)}. Leave them out with --drop {' --drop '.join(first)} "
                f"(KeyMap(drop=({', '.join(repr(p) for p in first)},))), or choose another prefix"
            )
        return names


KeyMapping = KeyMap | Callable[[str], str | None]
"""A :class:`KeyMap`, or a function from a state_dict key to its name in the directory (None leaves it out)."""


def output_names(keys: list[str], key_map: KeyMapping | None) -> dict[str, str]:
    """{state_dict key: name written} under ``key_map``, refusing an empty name and two keys given one name."""
    if key_map is None:
        names = {key: key for key in keys}
    elif isinstance(key_map, KeyMap):
        names = key_map.output_names(keys)
    else:
        mapped = {key: key_map(key) for key in keys}
        names = {key: name for key, name in mapped.items() if name is not None}
    empty = [key for key, name in names.items() if not name]
    if empty:
        raise HfExportError(f"the key map turns {_listing(empty)} into an empty name; drop it or rename it")
    sources: dict[str, list[str]] = {}
    for key, name in names.items():
        sources.setdefault(name, []).append(key)
    clashes = {name: keys for name, keys in sources.items() if len(keys) > 1}
    if clashes:
        name, clashing = next(iter(clashes.items()))
        raise HfExportError(
            f"the key map gives one name to several state_dict keys ({len(clashes)} name(s) affected), e.g. "
            f"{_listing(clashing)} all become {name!r}; drop all but one or rename them apart"
        )
    if not names:
        raise HfExportError("the key map leaves no state_dict key to write; check the prefix to strip and drop")
    return names


def keep_tied_aliases(config: dict[str, Any]) -> bool:
    """Whether every key of a tied parameter is written (see [Note: Hugging Face tied weights])."""
    return config.get("tie_word_embeddings") is False


# ------------------------------------------------------------------------------------------------ shards
_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"`` (10^9), ``"500MB"``, ``"2GiB"`` (2^30), ``"1000000"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE.match(str(size))
        unit = match.group(2) if match else ""
        if not match or unit.upper() not in _UNITS:
            raise HfExportError(
                f"max shard size {size!r} is not a size: write a whole number of bytes, optionally with a unit: "
                "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB or 500MB"
            )
        if unit[-1:] == "b" and not unit.upper().endswith("IB"):
            raise HfExportError(
                f"max shard size {size!r}: transformers reads a lowercase 'b' as bits; write {unit[:-1].upper()}B "
                "for bytes"
            )
        value = int(match.group(1)) * _UNITS[unit.upper()]
    if value <= 0:
        raise HfExportError(f"max shard size {size!r} must be positive")
    return value


def plan_shards(sizes: list[int], max_bytes: int) -> list[int]:
    """How many consecutive tensors go in each file: a file is closed when the next tensor would take it past
    ``max_bytes``; a tensor larger than that gets a file of its own (as transformers shards)."""
    counts: list[int] = []
    filled = 0
    for size in sizes:
        if counts and filled + size <= max_bytes:
            counts[-1] += 1
            filled += size
        else:
            counts.append(1)
            filled = size
    return counts


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# ------------------------------------------------------------------------------------------------ config
def config_text(config: ConfigSource | None) -> tuple[str, dict[str, Any]]:
    """The config.json to write (as given, for a file) and its content, checked to be one AutoConfig reads."""
    if config is None:
        raise HfExportError(MISSING_CONFIG)
    where = "the config"
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        if path.is_dir():
            path = path / CONFIG_NAME
        if not path.is_file():
            raise HfExportError(f"config {path} does not exist. {MISSING_CONFIG}")
        where, text = str(path), path.read_text(encoding="utf-8")
    elif isinstance(config, Mapping):
        text = json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    elif callable(getattr(config, "to_json_string", None)):
        text = config.to_json_string()
    else:
        raise HfExportError(
            f"config is a {type(config).__name__}; give a transformers PretrainedConfig, a dict, or the path of a "
            "config.json (or of its directory)"
        )
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        raise HfExportError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(content, dict) or not isinstance(content.get("model_type"), str) or not content["model_type"]:
        raise HfExportError(
            f'{where} has no "model_type" (e.g. "gpt2"), which AutoConfig / AutoModel read to choose the '
            "architecture; give the config.json of a transformers model (PretrainedConfig.to_json_file writes one)"
        )
    return text, content


def _listing(keys: list[str], most: int = 5) -> str:
    shown = ", ".join(repr(key) for key in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")
