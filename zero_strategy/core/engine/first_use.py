"""Where reads of ``p.grad`` end in a step: at the first forward of a module that holds parameters, not where the
step enters.

[Note: reads until the model computes]
The Trainer's step enters through a wrapper that runs ``training_step`` (the engine's entry module); user code there
runs before the model computes and may read ``p.grad``. Lightning zeroes gradients after ``training_step`` (in its
closure, before backward), so DDP's ``p.grad`` there holds the previous step's averaged gradient (at the first
micro-batch after a step) or this rank's own sum (inside an accumulation window). The class that answers reads
(core/flat/grad_reads.py) therefore stays on until the first module holding parameters starts its forward: a
pre-hook on each such module, a flag test once the class is off, so the model's forward still never pays for it.
At stages 1/2 the class is on from the end of the backward; at stage 3 the parameters outside forward have their
sharded class, which answers reads, except the root unit's (the parameters outside every other unit), which the
entry gathers (see [Note: every forward gathers] in core/runtime/hooks.py): a hook after that gather gives them
the reading class. The entry's own end takes it off too (before the root may be released: a validation step that
calls no module), and so does a release of the root (core/flat/access.py's ``wrap``).

A parameter that ``training_step`` computes with directly (a functional op on ``self.weight``) goes through the
reading class: the same values and gradients (it is the parameter itself), a little slower.

Not done where a module is compiled when the engine is built (``torch.compile(model)``, ``block.compile()``): the
pre-hooks would run inside dynamo's trace (a graph break each, or guards on the class's state), so the entry ends
the reads as before, and ``p.grad`` in ``training_step`` before the model's forward reads torch's attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zero_strategy.core.runtime.compile_check import is_compiled
from zero_strategy.core.runtime.owned_hook import OwnedHook


class ReadsUntilFirstUse:
    """Hooks that keep reads of ``p.grad`` answered from a step's entry (``entry``) to the first forward of a module
    of ``module`` holding parameters of ``params`` directly: ``start_reads`` after the entry's own pre-hooks (the
    root unit gathered), ``end_reads`` (idempotent, cheap once the reads ended) at that first forward and at the
    entry's end."""

    def __init__(self, module: nn.Module, entry: nn.Module, params: set[int], start_reads: Callable[[], None],
                 end_reads: Callable[[], None]) -> None:
        self._start_reads, self._end_reads = start_reads, end_reads
        self._handles: list[RemovableHandle] = [
            owner.register_forward_pre_hook(OwnedHook(self._before_compute))
            for owner in module.modules()
            if any(id(param) in params for param in owner.parameters(recurse=False))
        ]
        # registered before the engine's runtime hooks, which the entry runs first (prepended): after the gather
        self._handles.append(entry.register_forward_pre_hook(OwnedHook(self._entered)))
        # first among the entry's post-hooks: before the root unit's release, whatever forward raised
        self._handles.append(entry.register_forward_hook(OwnedHook(self._left), prepend=True, always_call=True))

    @staticmethod
    def applies(module: nn.Module) -> bool:
        """Whether reads may run on to the model's first computation (see [Note: reads until the model
        computes]): nothing in ``module`` is compiled."""
        return not any(is_compiled(inner) for inner in module.modules())

    def _entered(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self._start_reads()

    def _before_compute(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():  # compiled after the engine was built: no class swap inside a trace
            self._end_reads()

    def _left(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self._end_reads()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
