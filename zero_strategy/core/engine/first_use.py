"""Where stages 1/2 stop answering reads of ``p.grad`` in a step: at the first forward of a module that holds
parameters, not where the step enters.

[Note: reads until the model computes]
The Trainer's step enters through a wrapper that runs ``training_step`` (the engine's entry module); user code there
runs before the model computes and may read ``p.grad``. Lightning zeroes gradients after ``training_step`` (in its
closure, before backward), so DDP's ``p.grad`` there holds the previous step's averaged gradient (at the first
micro-batch after a step) or this rank's own sum (inside an accumulation window). The class that answers reads
(core/flat/grad_reads.py) therefore stays on until the first module holding parameters starts its forward: a
pre-hook on each such module, a flag test once the class is off, so the model's forward still never pays for it.
A parameter that ``training_step`` computes with directly (a functional op on ``self.weight``) goes through the
watched class: the same values, a little slower.

Not deferred where a module is compiled when the engine is built (``torch.compile(model)``, ``block.compile()``):
the pre-hooks would run inside dynamo's trace (a graph break each, or guards on the watch's state), so the entry
ends the reads as before, and ``p.grad`` in ``training_step`` before the model's forward reads torch's attribute.
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
    """Pre-forward hooks on every module of ``module`` that holds parameters of ``params`` directly, calling
    ``end_reads`` (idempotent and cheap once the reads ended) when the first of them computes."""

    def __init__(self, module: nn.Module, params: set[int], end_reads: Callable[[], None]) -> None:
        self._end_reads = end_reads
        self._handles: list[RemovableHandle] = [
            owner.register_forward_pre_hook(OwnedHook(self._before_compute))
            for owner in module.modules()
            if any(id(param) in params for param in owner.parameters(recurse=False))
        ]

    @staticmethod
    def applies(module: nn.Module) -> bool:
        """Whether reads may run on to the model's first computation (see [Note: reads until the model
        computes]): nothing in ``module`` is compiled."""
        return not any(is_compiled(inner) for inner in module.modules())

    def _before_compute(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # compiled after the engine was built: no class swap inside a trace
            return
        self._end_reads()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
