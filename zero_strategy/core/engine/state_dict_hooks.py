"""``module.state_dict()`` of a stage-3 module gives the full values, as with FSDP's full state dict (see [Note:
parameters outside forward] in core/flat/access.py).

Hooks on every module of the engine's module: the outermost ``state_dict`` call of a (sub)module gathers the
FlatParams of its parameters, and when it returns, every value it put in the state dict that is a view of a gathered
buffer is replaced by a copy, and the FlatParams it gathered are released again. A collective: every rank calls it
(as every rank calls FSDP's). ``keep_vars=True`` returns the parameter objects themselves and gathers nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from zero_strategy.core.flat.flat_param import FlatParam, ParamState
from zero_strategy.core.plan.tensor_parallel import local_part
from zero_strategy.core.runtime.owned_hook import OwnedHook


class StateDictGathers:
    """Installs and owns the state-dict hooks of one stage-3 engine."""

    def __init__(self, module: nn.Module, flats: list[FlatParam]) -> None:
        self._flats = flats
        self._owner_of = {id(param): flat for flat in flats for param in flat.params}
        self._handles: list[RemovableHandle] = []
        self._depth = 0
        self._gathered: list[FlatParam] = []
        self._quiet = False
        for sub in module.modules():
            self._handles.append(sub.register_state_dict_pre_hook(OwnedHook(self._before, sub)))
            self._handles.append(sub.register_state_dict_post_hook(OwnedHook(self._after)))  # torch marks the hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Within the block ``state_dict`` gathers nothing (the engine's own reads of keys and buffers, on one rank)."""
        quiet, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = quiet

    def _before(self, sub: nn.Module, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._quiet or keep_vars:
            return
        self._depth += 1
        if self._depth > 1:  # a child of a call already gathering
            return
        flats = {id(flat): flat for param in sub.parameters()
                 if (flat := self._owner_of.get(id(param))) is not None}.values()
        self._gathered = [flat for flat in flats if flat.state is not ParamState.UNSHARDED]
        for flat in self._gathered:
            flat.start_unshard()  # all posted before the first wait
        for flat in self._gathered:
            flat.unshard()

    def _after(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if self._quiet or self._depth == 0:  # keep_vars (no pre-hook counted) or quiet
            return
        self._depth -= 1
        if self._depth > 0:
            return
        # every value that is a view of a gathered buffer becomes a copy: the buffer is released below, or (a unit in
        # use, read inside forward) at the end of backward; on one host, the next step writes it in place
        buffers = {flat.full.untyped_storage().data_ptr() for flat in self._flats if flat.state is ParamState.UNSHARDED}
        for key, value in state_dict.items():
            if not (key.startswith(prefix) and isinstance(value, Tensor)):
                continue
            if local_part(value).untyped_storage().data_ptr() in buffers:  # a DTensor: its local block
                state_dict[key] = value.clone()
        gathered, self._gathered = self._gathered, []
        for flat in gathered:
            flat.reshard()
