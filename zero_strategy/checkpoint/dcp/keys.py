"""Which keys of a DCP checkpoint hold the model, and which the optimizer: the layouts other tools write.

[Note: reading other tools' DCP layouts]
DCP stores a flat key per leaf of the nested state dict it was given (``"model"`` → ``"model.<fqn>"``). The
model's tensors are found under the first of these prefixes that holds them:

- ``model.``      our export and online save, FSDP2 examples (``dcp.save({"model": ..., "optim": ...})``),
                  Lightning's FSDPStrategy sharded checkpoints;
- ``state_dict.`` Lightning's ModelParallelStrategy (FSDP2) sharded checkpoints;
- no prefix       torchtitan (the model's keys at the top level).

When the module's own keys are known (resuming), the prefix that matches most of them wins, so a module whose own
keys start with ``model.`` is not mistaken. An optimizer state dict (torch's ``get_optimizer_state_dict``, nested
or flattened) was saved under a root ``Q`` (``optim.``, ``optimizer.``, ``optimizer_0.`` …, or none) and is
recognised by its keys ``Q + "param_groups." …``; its per-parameter state is ``Q + "state.<fqn>.<name>"``, where
``<name>`` has no dot (``exp_avg``, ``step``), so the fqn is everything between. A root that ends in a number
(``optimizer_1.``: Lightning saves one root per optimizer; ``optim_1.``: ours, when several optimizers step one
parameter) holds that optimizer's state only; a root without one (``optim.``: every optimizer merged, as torch's
``get_optimizer_state_dict`` writes them) serves every optimizer.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zero_strategy.checkpoint.dcp.content import OURS, PARAM_GROUPS, PARAMS, STATE

MODEL_PREFIXES = ("model.", "state_dict.", "")


@dataclass(frozen=True, slots=True)
class OptimizerKeys:
    """One optimizer state dict inside a DCP checkpoint."""

    root: str  # "optim." / "optimizer_0." / ""
    serves: int | None  # the optimizer whose state it holds (its number), None: every optimizer (merged)
    state: dict[str, dict[str, str]]  # parameter fqn -> {state name: stored key}
    nested_groups: dict[int, dict[str, str]]  # group index -> {hyper-parameter (and "params"): stored key}
    flat_groups: dict[str, dict[str, str]]  # torchtitan's flattened layout: fqn -> {hyper-parameter: stored key}


@dataclass(frozen=True, slots=True)
class DcpKeys:
    model_prefix: str
    model: dict[str, str]  # the module's state_dict key -> stored key (tensors only)
    optimizers: list[OptimizerKeys]


def find_keys(entries: Mapping[str, object], expected: Collection[str] | None = None) -> DcpKeys:
    """The layout of a checkpoint whose metadata lists ``entries`` (stored key → storage metadata); ``expected``:
    the module's state_dict keys when known (see [Note: reading other tools' DCP layouts])."""
    roots = _optimizer_roots(entries)
    optimizers = [_optimizer_keys(entries, root) for root in roots]
    claimed = {key for keys in optimizers for key in _all_keys(keys)}
    tensors = [
        key
        for key, md in entries.items()
        if isinstance(md, TensorStorageMetadata) and key not in claimed and not key.startswith(f"{OURS}.")
    ]
    candidates = []
    for prefix in MODEL_PREFIXES:
        model = {key[len(prefix) :]: key for key in tensors if key.startswith(prefix)}
        if model:
            candidates.append((prefix, model))
    if not candidates:
        return DcpKeys("", {}, optimizers)
    if expected is not None:
        wanted = set(expected)
        prefix, model = max(candidates, key=lambda candidate: len(wanted & set(candidate[1])))
    else:
        prefix, model = candidates[0]
    return DcpKeys(prefix, model, optimizers)


def _optimizer_roots(keys: Collection[str]) -> list[str]:
    marker = f"{PARAM_GROUPS}."
    roots: set[str] = set()
    for key in keys:
        at = key.find(marker)
        while at != -1:
            root = key[:at]
            if root == "" or root.endswith("."):
                roots.add(root)
                break
            at = key.find(marker, at + 1)
    return sorted(roots)


def _optimizer_keys(entries: Collection[str], root: str) -> OptimizerKeys:
    state_prefix, groups_prefix = f"{root}{STATE}.", f"{root}{PARAM_GROUPS}."
    state: dict[str, dict[str, str]] = {}
    nested: dict[int, dict[str, str]] = {}
    flat: dict[str, dict[str, str]] = {}
    for key in entries:
        if key.startswith(state_prefix) and "." in key[len(state_prefix) :]:
            fqn, name = key[len(state_prefix) :].rsplit(".", 1)
            state.setdefault(fqn, {})[name] = key
        elif key.startswith(groups_prefix) and "." in key[len(groups_prefix) :]:
            owner, name = key[len(groups_prefix) :].rsplit(".", 1)
            if owner.isdigit() and f"{groups_prefix}{owner}.{PARAMS}" in entries:
                nested.setdefault(int(owner), {})[name] = key
            else:
                flat.setdefault(owner, {})[name] = key
    numbered = re.search(r"(\d+)\.$", root)
    return OptimizerKeys(root, int(numbered.group(1)) if numbered else None, state, nested, flat)


def _all_keys(keys: OptimizerKeys) -> list[str]:
    found = [key for names in keys.state.values() for key in names.values()]
    found += [key for names in keys.nested_groups.values() for key in names.values()]
    return found + [key for names in keys.flat_groups.values() for key in names.values()]
