"""Runtime hooks: gather units before they compute, reduce their gradients as backward finishes, free them after.

Stage 3 installs forward pre/post hooks on every unit (the root's on the forward entry point), and a hook on each
unit's outputs that gathers the unit again when backward reaches it. Stages 2 and 3 install a post-accumulate-grad
hook on every trainable parameter: when the last gradient of a unit has landed, the unit is reduce-scattered in
the agreed order (stage 3 frees it; when and in which order gradients are reduced is backward_reductions.py's). A
callback queued at the start of each backward sweeps up at its end: units not reduced yet are reduced there, and
every unit is freed.

[Note: prefetch]
Forward prefetches the next unit in the order the first forward recorded. Backward does not simply reverse it:
with nested units (a block and, inside it, a large MLP layer that is a unit of its own) the block's hook fires
before its children's, so reversed forward order would fetch the wrong unit and every block would be gathered
while backward waited. The first backward records the order in which units' backward hooks fire; later ones
prefetch along it, and the first unit backward needs is fetched as soon as the root's forward returns.

Stage 3 gathers are collectives too unless the shards are in shared memory (one host's CPU ranks, where a gather
is a local copy): there rank-dependent use just works. With network gathers a rank that gathers a unit its peers
do not gather would wait forever, see [Note: diverging gathers] in core/comm/watch.py.

[Note: container units]
A ``ModuleList``/``ModuleDict`` made one unit (all experts of a mixture-of-experts layer, so that their gathers
and reductions are one exchange whichever experts a rank routes to) has no forward of its own: its hooks go on
its children, so calling any child gathers the whole unit and each child's outputs gather it again for backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from zero_strategy.core.runtime.backward_reductions import BackwardReductions, GradientSync
from zero_strategy.core.runtime.compile_check import not_traced
from zero_strategy.core.runtime.forward_writes import ForwardWrites
from zero_strategy.core.runtime.owned_hook import OwnedHook
from zero_strategy.core.runtime.reduction_order import ReductionOrder
from zero_strategy.core.runtime.unit import TrainingState, ZeroUnit
from zero_strategy.core.stage import ZeroStage

PREFETCH_DEPTH = 1
"""Units gathered ahead of the one computing. Two ahead hid more of the gathers of nested units (a block's hook
fires just before its first child unit computes), but the 30 M benchmark's step time did not move (1.03x vs 1.04x
DDP, within noise: on 2 cores the bytes cost CPU whether or not a rank waits for them), so the memory bound wins:
at most the computing unit and the next one are whole."""


def in_backward() -> bool:
    """True while autograd's engine runs a backward (so a forward now is an activation-checkpoint recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


class RuntimeHooks:
    """Installs and owns the hooks that drive gathering, reduction and freeing of units during a step."""

    def __init__(
        self,
        units: list[ZeroUnit],
        stage: ZeroStage,
        entry_module: nn.Module,
        prefetch: bool,
        on_root_forward: Callable[[], None],
        reduction_order: ReductionOrder,
        on_backward_end: Callable[[bool], None] = lambda held: None,
        on_root_forward_end: Callable[[bool], None] = lambda backward_follows: None,
    ) -> None:
        """``on_backward_end``: called at the end of every backward that produced a gradient here, with whether it
        ran under a hold (see [Note: gradients held on the module]). ``on_root_forward_end``: after each outermost
        forward of the entry module, with whether a backward may follow (its output requires a gradient)."""
        self.units = units
        self.stage = stage
        self.entry_module = entry_module
        self.prefetch = prefetch
        self.on_root_forward = on_root_forward
        self.on_backward_end = on_backward_end
        self.on_root_forward_end = on_root_forward_end
        self.reductions = BackwardReductions(units, stage, reduction_order, self._queue_final_callback)
        self.forward_order: list[ZeroUnit] = []  # recorded during the first forward, used to prefetch
        self._order_recorded = False
        self.backward_order: list[ZeroUnit] = []  # recorded during the first backward (see [Note: prefetch])
        self._backward_order_recorded = False
        self._callback_queued = False
        self._entry_depth = 0  # forwards of the entry module running now (see [Note: every forward gathers])
        self._handles: list[RemovableHandle] = []
        # stage 3 on one host's shared memory: writes inside forward refused as they are made (None elsewhere; see
        # [Note: writes inside forward on shared memory] in forward_writes.py)
        flats = [flat for unit in units for flat in unit.flat_params]
        self.forward_writes = ForwardWrites.for_flats(flats) if stage.reshards_parameters else None

    def install(self) -> None:
        for unit in self.units:
            if self.stage.reshards_parameters:
                for module in self._forward_entries(unit):
                    self._handles.append(
                        module.register_forward_pre_hook(OwnedHook(self._pre_forward, unit), prepend=True)
                    )
                    self._handles.append(module.register_forward_hook(OwnedHook(self._post_forward, unit)))
                    if self.forward_writes is not None:  # a recomputation's mode goes even when it raises
                        self._handles.append(module.register_forward_hook(
                            OwnedHook(self._after_recomputation), always_call=True))
                if unit.is_root:  # see [Note: every forward gathers]
                    for module in self._root_users(unit):
                        self._handles.append(module.register_forward_pre_hook(
                            OwnedHook(self._pre_inner_root_forward, unit), prepend=True))
                        self._handles.append(module.register_forward_hook(
                            OwnedHook(self._post_inner_root_forward, unit)))
        self._handles += self.reductions.install()
        # The step's own hooks go on the entry point whether or not the root stores parameters (a root whose
        # parameters all live in children has no unit): registered last with prepend, the pre-hook runs before the
        # root unit's gather, and the post-hook after the root unit's.
        self._handles.append(
            self.entry_module.register_forward_pre_hook(OwnedHook(self._pre_root_forward), prepend=True))
        self._handles.append(
            self.entry_module.register_forward_hook(OwnedHook(self._post_root_forward), always_call=True))

    def _root_users(self, root: ZeroUnit) -> list[nn.Module]:
        """The module itself (when the step enters elsewhere) and every module that holds root-unit parameters
        directly: calling any of them uses the root's parameters."""
        owned = {id(param) for flat in root.flat_params for param in flat.params}
        users = [module for module in root.module.modules() if module is not self.entry_module
                 and any(id(param) in owned for param in module.parameters(recurse=False))]
        if root.module is not self.entry_module and root.module not in users:
            users.insert(0, root.module)
        return users

    def _forward_entries(self, unit: ZeroUnit) -> list[nn.Module]:
        """The modules whose forward hooks gather ``unit`` (see [Note: container units])."""
        if unit.is_root:
            return [self.entry_module]
        if type(unit.module).forward is nn.Module.forward:  # a container: nothing calls it, its children compute
            children = list(unit.module.children())
            if not children:
                raise ValueError(f"ZeRO unit {unit.name!r} has no forward and no children; it can never be gathered")
            return children
        return [unit.module]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --------------------------------------------------------------------------------------------- forward
    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _pre_root_forward(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            if self.forward_writes is not None:  # first: the always-called post hook takes it off again
                self.forward_writes.enter()
            self._entry_depth += 1
            self.on_root_forward()

    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _post_root_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        if self.forward_writes is not None:
            self.forward_writes.exit()
        self._entry_depth -= 1
        backward_follows = torch.is_grad_enabled() and any(
            isinstance(tensor, Tensor) and tensor.requires_grad for tensor in tree_flatten(output)[0])
        if self._entry_depth == 0:
            self.on_root_forward_end(backward_follows)
        if not self.stage.reshards_parameters:
            return
        self._order_recorded = True
        if self.prefetch and self._backward_order_recorded and backward_follows:
            # the loss and the root's own backward run while the first unit backward needs is gathered (not after a
            # step that ran its own backward inside: manual optimization returns no loss to backpropagate)
            first = next((u for u in self.backward_order if not u.is_root), None)
            if first is not None:
                first.start_unshard()

    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _pre_forward(self, unit: ZeroUnit, module: nn.Module, args: Any) -> None:
        if in_backward():  # recomputation under activation checkpointing: the unit must be whole again
            if self.forward_writes is not None:  # first: the always-called post hook takes it off again
                self.forward_writes.enter()
            unit.unshard()
            return
        unit.unshard()
        unit.state = TrainingState.FORWARD
        if not self._order_recorded:
            if unit not in self.forward_order:
                self.forward_order.append(unit)
        elif self.prefetch:
            self._prefetch(self.forward_order, unit, step=1)

    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _post_forward(self, unit: ZeroUnit, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward():
            return
        unit.state = TrainingState.IDLE
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, Tensor) and tensor.requires_grad:
                    tensor.register_hook(OwnedHook(self._pre_backward, unit))
        # After a training forward the root and the last unit forward ran stay whole: backward needs them first,
        # and freeing them would only gather them again right away (the end of backward frees them).
        last = self._order_recorded and self.forward_order and unit is self.forward_order[-1]
        if not ((unit.is_root or last) and torch.is_grad_enabled()):
            unit.reshard()

    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _after_recomputation(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward() and self.forward_writes is not None:
            self.forward_writes.exit()

    # [Note: every forward gathers]
    # The root unit (the parameters outside any other unit) is gathered when the step's forward enters the entry
    # module (Lightning's wrapper, around training_step) and stays whole until the end of backward. But its
    # parameters are also used by forwards that do not go through the entry: the module's own forward called
    # again after a backward in one step (a closure: forward, backward, forward, backward; a GAN's generator and
    # discriminator steps), after which the root was released at the end of the first backward; or a submodule
    # called outside any step (a callback evaluating ``pl_module.model(x)``). So the module itself and every
    # module holding root parameters gather the root before they compute. Their outputs bring it back for their
    # backward; inside the entry's forward they never release it (the step may use the root's parameters after
    # they return); outside it, a forward without gradients releases it when it returns (nothing else would).
    # Inside the entry's forward the root is usually whole already (a second forward after a backward in the same
    # step is the exception) and then stays so until the end of backward: there these hooks only read the depth
    # and the root's state, which dynamo traces, so a whole compiled model does not break its graph at every
    # module that holds root parameters.
    def _pre_inner_root_forward(self, unit: ZeroUnit, module: nn.Module, args: Any) -> None:
        if self._entry_depth == 0 or not unit.whole:
            self._gather_root_outside_entry(unit)

    def _post_inner_root_forward(self, unit: ZeroUnit, module: nn.Module, args: Any, output: Any) -> None:
        if self._entry_depth == 0:
            self._after_root_use_outside_entry(unit, output)

    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _gather_root_outside_entry(self, unit: ZeroUnit) -> None:
        unit.unshard()
        if not in_backward():
            unit.state = TrainingState.FORWARD

    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _after_root_use_outside_entry(self, unit: ZeroUnit, output: Any) -> None:
        if in_backward():
            return
        if not torch.is_grad_enabled():
            unit.reshard()
            unit.state = TrainingState.IDLE
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, Tensor) and tensor.requires_grad:
                tensor.register_hook(OwnedHook(self._pre_backward, unit))

    @staticmethod
    def _prefetch(order: list[ZeroUnit], unit: ZeroUnit, step: int) -> None:
        """Start gathering the ``PREFETCH_DEPTH`` units after ``unit`` in ``order`` (``step`` -1: before it)."""
        if unit not in order:
            return
        index = order.index(unit)
        for distance in range(1, PREFETCH_DEPTH + 1):
            if 0 <= index + distance * step < len(order):
                order[index + distance * step].start_unshard()

    # -------------------------------------------------------------------------------------------- backward
    @not_traced  # see [Note: torch.compile] in compile_check.py
    def _pre_backward(self, unit: ZeroUnit, grad: Tensor) -> None:
        self._queue_final_callback()
        if unit.state is TrainingState.BACKWARD:
            return
        unit.state = TrainingState.BACKWARD
        unit.unshard()
        if not self._backward_order_recorded:
            if unit not in self.backward_order:
                self.backward_order.append(unit)
            if self.prefetch:  # first backward: guess the reverse of forward order
                self._prefetch(self.forward_order, unit, step=-1)
        elif self.prefetch:
            self._prefetch(self.backward_order, unit, step=1)

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._backward_order_recorded = bool(self.backward_order)
        held = self.reductions.sync is GradientSync.HELD
        self.reductions.end_of_backward()
        for unit in self.units:
            if self.stage.reshards_parameters:
                unit.reshard()
            unit.state = TrainingState.IDLE
        self._callback_queued = False
        self.on_backward_end(held)
