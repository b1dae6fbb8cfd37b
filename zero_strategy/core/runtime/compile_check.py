"""Where ``torch.compile`` meets stage-3 units: a compiled module with units inside it breaks its graph at each of
them. Training stays right; :class:`CompiledAroundUnitsWarning` only tells the user where the breaks are and how to
avoid them.

[Note: torch.compile]
The hooks are never traced by dynamo (``torch.compiler.disable``); they always run eagerly, between graphs.
A gather is a collective that resizes and fills a storage in place, which dynamo cannot put in a graph; traced,
our hooks broke the graph at every collective and at ``in_backward()``, and dynamo guarded on their Python state
(the recorded orders, a unit's state), so it compiled again each time that state moved over the first steps
(zero3, three compiled blocks: 21 frames compiled in the first step and 8 more in the next two, against 1 in all
with the hooks disabled; tests/distributed/test_compile.py). Disabled, they cost nothing where the compiled code
is a unit's own forward (``block.compile()`` or ``torch.compile(block)``: the hooks sit outside the compiled
call, one graph serves every identical block), and one graph break per unit called from inside a compiled
stage-3 forward (``torch.compile(whole_model)``; where the units are called in a loop dynamo gives that frame up
to eager and compiles each unit's forward on its own; with ``fullgraph=True`` dynamo's error quotes the reason
given below). The compiled code reads the parameters as graph inputs, which keep their tensor objects, shapes
and strides while their storage is freed and refilled, so guards hold and nothing recompiles; tensors a compiled
forward saves for backward are views of the same storage and see the gathered values again, as in eager mode.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

not_traced = torch.compiler.disable(
    reason="ZeRO gathers or frees a unit's parameters here (a collective that cannot be traced): compile each "
    "unit's module (block.compile()) instead of a whole stage-3 model with fullgraph=True"
)
"""The decorator of every runtime hook (see [Note: torch.compile])."""


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
