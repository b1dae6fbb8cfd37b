"""Where ``torch.compile`` meets stage-3 units: a compiled module with units inside it breaks its graph at each of
them (see [Note: torch.compile] in hooks.py). Training stays right; this only tells the user where the breaks are
and how to avoid them."""

from __future__ import annotations

import warnings

from torch import nn


class CompiledAroundUnitsWarning(UserWarning):
    """A compiled module contains stage-3 units: each unit's gather breaks the compiled graph."""


def is_compiled(module: nn.Module) -> bool:
    """``module.compile()`` (in place) or ``torch.compile(module)`` (an OptimizedModule wrapping it)."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def compiled_modules_around_units(root: nn.Module, unit_paths: list[str]) -> dict[str, list[str]]:
    """Compiled modules (by path) and the units strictly inside them (the root unit "" has no module around it)."""
    found: dict[str, list[str]] = {}
    for path, module in root.named_modules():
        if not is_compiled(module):
            continue
        inside = [u for u in unit_paths if u and u != path and (not path or u.startswith(path + "."))]
        if inside:
            found[path] = inside
    return found


def warn_compiled_around_units(root: nn.Module, unit_paths: list[str]) -> None:
    """Stage 3: warn once per compiled module that has units inside it."""
    for path, inside in compiled_modules_around_units(root, unit_paths).items():
        shown = ", ".join(repr(u) for u in inside[:4]) + (f" and {len(inside) - 4} more" if len(inside) > 4 else "")
        warnings.warn(
            f"ZeRO stage 3: the compiled module {path or '<root>'!r} contains units ({shown}); each one's "
            "parameters are gathered by a collective that torch.compile cannot trace, so its graph breaks at "
            "every such unit (training is unaffected). For no graph break, compile the units themselves "
            "(block.compile() for each block), and make them the only units inside (unit_modules=[<block class "
            "name>]) so that no smaller unit is gathered inside a compiled block.",
            CompiledAroundUnitsWarning,
            stacklevel=3,
        )
