"""Names of pretrained weights: renaming a file's keys (``key_map``) and matching them against a module's.

[Note: key_map]
``key_map`` turns each key *of the file* into the name the module's ``state_dict()`` uses, or drops it:

- ``None``: keys are used as they are.
- a string ``P``: the same as ``{"strip_prefix": P}``.
- ``{"strip_prefix": S, "add_prefix": A}`` (either may be left out): a key that starts with ``S`` loses it (a key
  without it is kept as it is: HF checkpoints often hold ``transformer.*`` next to an unprefixed ``lm_head.*``),
  then every key gets ``A`` in front. A dict whose keys are only these two words is read as this rule, never as a
  rename table (no real tensor is called ``strip_prefix``); YAML spells it ``{strip_prefix: "model."}``.
- any other dict ``{old: new}``: listed keys are renamed (``new=None`` drops the key), the others kept.
- a function ``old -> new | None`` (``None`` drops the key).

Two file keys renamed to the same name are an error: which one should load would otherwise depend on file order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor, nn

from zero_strategy.checkpoint.base.format import CheckpointError

KeyMap = str | Mapping[str, str | None] | Callable[[str], str | None] | None
PREFIX_RULE_WORDS = frozenset({"strip_prefix", "add_prefix"})
LISTED_PER_KIND = 20
"""An error message lists at most this many keys of each kind (missing, unexpected, mismatched), then a count."""


class PretrainedMismatchError(CheckpointError):
    """The file's keys do not fit the module: the message lists every missing, unexpected and mismatched key."""


def key_map_function(key_map: KeyMap) -> Callable[[str], str | None]:
    """The renaming ``key_map`` describes, as one function (see [Note: key_map])."""
    if key_map is None:
        return lambda key: key
    if isinstance(key_map, str):
        return key_map_function({"strip_prefix": key_map})
    if isinstance(key_map, Mapping):
        if key_map and set(key_map) <= PREFIX_RULE_WORDS:
            return _prefix_rule(key_map.get("strip_prefix") or "", key_map.get("add_prefix") or "")
        table = dict(key_map)
        return lambda key: table.get(key, key)
    if callable(key_map):
        return key_map
    raise TypeError(
        f"key_map must be None, a prefix to strip (str), {{'strip_prefix': ..., 'add_prefix': ...}}, a dict "
        f"{{old: new}} or a function old -> new | None; got a {type(key_map).__name__}"
    )


def _prefix_rule(strip: object, add: object) -> Callable[[str], str | None]:
    if not isinstance(strip, str) or not isinstance(add, str):
        raise TypeError(f"key_map's strip_prefix and add_prefix must be strings; got {strip!r} and {add!r}")
    return lambda key: add + (key[len(strip) :] if strip and key.startswith(strip) else key)


def renamed_keys(file_keys: Iterable[str], key_map: KeyMap, where: str) -> dict[str, str]:
    """{module-side name: file key} for every file key ``key_map`` keeps, in file order. ``where`` names the
    source in errors."""
    rename = key_map_function(key_map)
    names: dict[str, str] = {}
    for key in file_keys:
        name = rename(key)
        if name is None:
            continue
        if not isinstance(name, str):
            raise TypeError(f"key_map returned {name!r} for {key!r}; it must return a str or None (drop the key)")
        if name in names:
            raise CheckpointError(
                f"{where}: key_map renames both {names[name]!r} and {key!r} to {name!r}; map one of them to None "
                "(drop it) or to another name"
            )
        names[name] = key
    return names


# ------------------------------------------------------------------------------------------------ matching
class TensorShapes(Protocol):
    """What matching needs from a source (``PretrainedSource`` provides it)."""

    def keys(self) -> list[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...


@dataclass(slots=True)
class KeyMatch:
    """How a module's state_dict is filled from a source.

    ``sources`` maps each module name that will be loaded to the source name it is read from (an alias of a tied
    group is read from whichever name of its group the file holds). ``missing``: module names nothing fills
    (left as they are; only possible with ``strict=False``). ``unexpected``: source names nothing reads."""

    sources: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def match_keys(
    source: TensorShapes,
    expected: Mapping[str, Sequence[int]],
    strict: bool = True,
    aliases: Iterable[Sequence[str]] = (),
    where: str = "the pretrained weights",
) -> KeyMatch:
    """Match ``source``'s names against ``expected`` (module name → shape) and raise ONE
    :class:`PretrainedMismatchError` listing every problem: a shape mismatch always, missing and unexpected keys
    when ``strict``. ``aliases`` are groups of module names that share one tensor (tied weights, see
    :func:`alias_groups`): a group is present when the file holds any of its names."""
    group_of: dict[str, tuple[str, ...]] = {}
    for group in aliases:
        members = tuple(name for name in group if name in expected)
        for name in members:
            group_of[name] = members
    match = KeyMatch()
    mismatched: list[str] = []
    for name, shape in expected.items():
        present = [alias for alias in group_of.get(name, (name,)) if alias in source]
        if not present:
            match.missing.append(name)
            continue
        match.sources[name] = present[0]
        if name in source and tuple(source.shape(name)) != tuple(shape):
            mismatched.append(f"{name}: module {list(shape)}, file {list(source.shape(name))}")
        elif name not in source and tuple(source.shape(present[0])) != tuple(shape):
            mismatched.append(
                f"{name} (tied to {present[0]}): module {list(shape)}, file {list(source.shape(present[0]))}"
            )
    match.unexpected = [key for key in source.keys() if key not in expected]
    if mismatched or (strict and (match.missing or match.unexpected)):
        raise PretrainedMismatchError(_mismatch_message(where, match, mismatched, strict))
    return match


def _mismatch_message(where: str, match: KeyMatch, mismatched: list[str], strict: bool) -> str:
    lines = [f"cannot load {where} into the module:"]
    if strict:
        lines += _listed("missing (in the module, not in the file)", match.missing)
        lines += _listed("unexpected (in the file, not in the module)", match.unexpected)
    lines += _listed("shape mismatch", mismatched, separator="; ")
    hint = _prefix_hint(match.missing, match.unexpected)
    lines.append(
        "Rename the file's keys with key_map (a prefix to strip, {'strip_prefix': ..., 'add_prefix': ...}, a dict "
        "{old: new} or a function; mapping a key to None drops it)"
        + (f", e.g. key_map={hint}" if hint else "")
        + "; strict=False loads the keys that match and leaves the module's other tensors as initialized (e.g. a "
        "new head). A shape mismatch is an error even with strict=False: drop that key with key_map."
    )
    return "\n".join(lines)


def _listed(title: str, items: list[str], separator: str = ", ") -> list[str]:
    if not items:
        return []
    shown = separator.join(items[:LISTED_PER_KIND])
    more = f" ... and {len(items) - LISTED_PER_KIND} more" if len(items) > LISTED_PER_KIND else ""
    return [f"  {len(items)} {title}: {shown}{more}"]


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """A prefix rule that would turn an unexpected key into a missing one, if one obviously would."""
    for key in unexpected[:200]:
        for name in missing[:200]:
            if key.endswith(name) and key != name:
                return repr({"strip_prefix": key[: -len(name)]})
            if name.endswith(key) and key != name:
                return repr({"add_prefix": name[: -len(key)]})
    return None


# ------------------------------------------------------------------------------------------------ modules
def expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """{state_dict key: shape} of every tensor in ``module.state_dict()`` (parameters, frozen ones too, and
    persistent buffers; non-tensor extra state is not a weight and is left out)."""
    return {
        key: tuple(value.shape) for key, value in module.state_dict(keep_vars=True).items() if isinstance(value, Tensor)
    }


def alias_groups(module: nn.Module) -> list[tuple[str, ...]]:
    """Groups of state_dict keys that are one tensor (tied weights such as GPT-2's ``lm_head.weight`` and
    ``transformer.wte.weight``), in state_dict order; keys that stand alone are not listed."""
    by_tensor: dict[int, list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor):
            by_tensor.setdefault(id(value), []).append(key)
    return [tuple(keys) for keys in by_tensor.values() if len(keys) > 1]
