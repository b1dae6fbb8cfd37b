"""Deciding the communication units: which modules become units and which unit stores each parameter.

A unit is gathered, reduced and freed as one piece: one bucket for the collectives, and at stage 3 the amount of
the model that is whole at any moment. The transformer block is the natural unit, so by default every child of
an ``nn.ModuleList`` (GPT-2's ``h``, Llama's ``layers``, BERT's ``layer``) is one, plus any module that reaches a
size threshold on its own; whatever is left belongs to the root unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(slots=True)
class UnitPlan:
    """A module chosen as a unit and the parameters it stores (each parameter in exactly one unit)."""

    name: str  # module path inside the root ("" for the root)
    module: nn.Module
    named_params: list[tuple[str, nn.Parameter]]


def choose_unit_modules(root: nn.Module, unit_classes: list[str], min_unit_numel: int) -> list[str]:
    """Module paths that become units, outermost first; the root ("") is always one."""
    if unit_classes:
        chosen = [
            name
            for name, module in root.named_modules()
            if name and (type(module).__name__ in unit_classes or type(module).__qualname__ in unit_classes)
        ]
        return ["", *chosen]
    chosen_set: set[str] = set()
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList):
            for child_name, child in module.named_children():
                if any(True for _ in child.parameters()):
                    chosen_set.add(f"{name}.{child_name}" if name else child_name)
    chosen_set |= _modules_over_threshold(root, min_unit_numel, chosen_set)
    ordered = [name for name, _ in root.named_modules() if name in chosen_set]
    return ["", *ordered]


def _modules_over_threshold(root: nn.Module, min_unit_numel: int, already: set[str]) -> set[str]:
    """Post-order: a module whose parameters not yet claimed by a unit below it reach the threshold."""
    chosen: set[str] = set()

    def visit(name: str, module: nn.Module) -> int:
        unclaimed = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            below = visit(path, child)
            if path not in already and path not in chosen:
                unclaimed += below
        if name and name not in already and unclaimed >= min_unit_numel:
            chosen.add(name)
            return 0
        return 0 if name in already else unclaimed

    visit("", root)
    return chosen


def _owner_unit(module_path: str, unit_paths: list[str]) -> str:
    """The innermost unit whose subtree contains ``module_path``."""
    best = ""
    for unit in unit_paths:
        if unit and (module_path == unit or module_path.startswith(unit + ".")) and len(unit) > len(best):
            best = unit
    return best


def _common_unit(paths: list[str], unit_paths: list[str]) -> str:
    """The innermost unit that contains every one of ``paths`` (units: owner of their common prefix)."""
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for pieces in zip(*parts, strict=False):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return _owner_unit(".".join(common), unit_paths)


def plan_units(root: nn.Module, unit_paths: list[str]) -> list[UnitPlan]:
    """Assign each distinct parameter to one unit.

    A parameter used by modules of different units (tied embedding and output layer) goes to the innermost unit
    that contains all of them — usually the root, which is whole for the entire forward and backward — so it is
    stored and reduced once and is present wherever it is used.
    """
    users: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for module_path, module in root.named_modules(remove_duplicate=False):
        for local_name, param in module.named_parameters(recurse=False):
            users.setdefault(id(param), []).append(_owner_unit(module_path, unit_paths))
            first_name.setdefault(id(param), f"{module_path}.{local_name}" if module_path else local_name)
            params[id(param)] = param
    plans = {path: UnitPlan(path, root.get_submodule(path), []) for path in unit_paths}
    for key, owners in users.items():
        unit = owners[0] if len(set(owners)) == 1 else _common_unit(owners, unit_paths)
        plans[unit].named_params.append((first_name[key], params[key]))
    return [plans[path] for path in unit_paths if plans[path].named_params]
