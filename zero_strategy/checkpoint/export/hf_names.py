"""Whether the names a Hugging Face export writes are the names of the model its config builds.

[Note: checking the names against the config's model]
``from_pretrained`` loads a directory whose tensor names fit none of the model's parameters without an error: it
logs a warning and returns the model at its random initial values. The commonest way there is a LightningModule
holding the model as ``self.model``, exported without ``--strip-prefix model.``. The export holds the config, so
before anything is written it builds the model the config describes on the meta device (no memory: shapes only;
the classes in the config's ``architectures``, else ``AutoModelForCausalLM`` and ``AutoModel``) and checks every
name written against that model's state_dict keys, as ``from_pretrained`` matches them (a base model's names load
into a model with a head and back, through the class's ``base_model_prefix``). Then:

- every name fits: nothing to say;
- the user gave no prefix to strip, and exactly one prefix of the keys (``model.``, ``model.backbone.``, ...) makes
  every name fit once stripped: it is stripped, and a note says so (the CLI prints it on stderr);
- otherwise the export is refused before anything is written, naming the names that fit nothing and, when
  stripping a prefix makes names fit, that prefix (and ``--drop`` for keys outside it).

A model transformers cannot build from the config (transformers not installed, an architecture it does not know,
remote code) is not checked, and the note says so; ``check_names=False`` (``--no-name-check``) skips the check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from zero_strategy.checkpoint.export.hf_layout import HfExportError, KeyMap, KeyMapping, output_names

Note = Callable[[str], object]


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigModel:
    """The names of the model(s) a config builds."""

    description: str  # e.g. "GPT2LMHeadModel / GPT2Model"
    names: frozenset[str]  # state_dict keys (parameters and persistent buffers)
    base_prefixes: frozenset[str]  # base_model_prefix of each class ("transformer", "model", ...)

    def fits(self, name: str) -> bool:
        if name in self.names:
            return True
        for prefix in self.base_prefixes:  # from_pretrained adds or removes the base model's prefix
            if f"{prefix}.{name}" in self.names or (name.startswith(f"{prefix}.") and
                                                     name[len(prefix) + 1 :] in self.names):  # fmt: skip
                return True
        return False


def build_config_model(content: dict[str, Any]) -> ConfigModel | str:
    """The names of the model ``content`` (a config.json's content) describes, built on the meta device; or why it
    cannot be built."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    settings = {key: value for key, value in content.items() if key != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(content["model_type"], **settings)
    except (ValueError, KeyError, TypeError) as error:
        return f"transformers builds no config for model_type {content['model_type']!r} ({error})"
    named = [getattr(transformers, name, None) for name in content.get("architectures") or []]
    classes: list[Any] = [cls for cls in named if cls is not None] or [
        transformers.AutoModelForCausalLM, transformers.AutoModel]
    models = []
    with torch.device("meta"):
        for cls in classes:
            try:
                models.append(cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config))
            except Exception:  # a head this architecture lacks (or cannot build): another class may fit
                continue
    if not models:
        return f"transformers cannot build {' or '.join(cls.__name__ for cls in classes)} from the config"
    return ConfigModel(
        " / ".join(type(model).__name__ for model in models),
        frozenset(name for model in models for name in model.state_dict()),
        frozenset(model.base_model_prefix for model in models if getattr(model, "base_model_prefix", "")),
    )


def _prefixes(key: str) -> list[str]:
    """``"a.b.c"`` → ``["a.", "a.b."]``: the attribute paths a key may sit under."""
    parts = key.split(".")
    return [".".join(parts[:end]) + "." for end in range(1, len(parts))]


def _misfits(keys: list[str], key_map: KeyMapping | None, model: ConfigModel) -> list[str] | None:
    """The names ``key_map`` writes that fit nothing (None: the key map refuses these keys)."""
    try:
        names = output_names(keys, key_map)
    except HfExportError:
        return None
    return [name for name in names.values() if not model.fits(name)]


def fitted_key_map(
    keys: list[str], key_map: KeyMapping | None, content: dict[str, Any], note: Note
) -> KeyMapping | None:
    """``key_map``, or it with the one prefix stripped that makes every name fit the config's model; raises
    :class:`HfExportError` when names fit nothing (see [Note: checking the names against the config's model])."""
    model = build_config_model(content)
    if isinstance(model, str):
        note(f"the names written were not checked against the model of the config: {model}")
        return key_map
    misfits = _misfits(keys, key_map, model)
    if misfits == []:
        return key_map
    if key_map is None or (isinstance(key_map, KeyMap) and not key_map.strip_prefix):
        base = key_map or KeyMap()
        kept = [key for key in keys if not key.startswith(base.drop)]  # a prefix to strip lies over each of them
        fitting = [prefix for prefix in (_prefixes(kept[0]) if kept else [])
                   if _misfits(keys, dataclasses.replace(base, strip_prefix=prefix), model) == []]  # fmt: skip
        if len(fitting) == 1:
            note(f"stripped the prefix {fitting[0]!r} from every state_dict key: the names then fit "
                 f"{model.description} built from the config (--strip-prefix {fitting[0]} says so)")
            return dataclasses.replace(base, strip_prefix=fitting[0])
    raise HfExportError(_refusal(keys, misfits or [], model))


def _refusal(keys: list[str], misfits: list[str], model: ConfigModel) -> str:
    expected = sorted(model.names)
    shown = misfits or keys
    message = (
        f"{len(shown)} name(s) written fit no parameter or buffer of {model.description} built from the config "
        f"(e.g. {', '.join(repr(name) for name in shown[:3])}; it expects e.g. "
        f"{', '.join(repr(name) for name in expected[:3])}): from_pretrained would leave those weights at their "
        "random initial values."
    )
    # The prefix under which most keys fit, once stripped: the likely attribute path of the model.
    best, best_count = "", 0
    for prefix in {prefix for key in keys for prefix in _prefixes(key)}:
        count = sum(1 for key in keys if key.startswith(prefix) and model.fits(key[len(prefix) :]))
        if count > best_count or (count == best_count and len(prefix) < len(best)):
            best, best_count = prefix, count
    if best_count:
        outside = sorted({key.split(".")[0] for key in keys if not key.startswith(best)})
        drop = "".join(f" --drop {prefix}" for prefix in outside)
        dropped = f", drop={tuple(outside)!r}" if outside else ""
        hint = f"--strip-prefix {best}{drop} (KeyMap(strip_prefix={best!r}{dropped}))"
        return f"{message} Strip the model's attribute path: {hint}"
    return (f"{message} Map the names with --strip-prefix / --rename / --drop, or skip this check with "
            "--no-name-check (check_names=False) if the config does not describe the model saved.")
