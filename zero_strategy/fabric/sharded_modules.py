"""The modules a ZeroFabricStrategy set up, each with its engine, and binding optimizers set up after the module.

[Note: optimizers set up after their module]
Fabric's split path (``setup_module(model)``, then an optimizer built from ``model.parameters()``, then
``setup_optimizers(optimizer)``: litgpt's scripts, FSDP's required order) must shard the module before any
optimizer exists: the optimizer is built from the module's parameters, which must be real by then (Fabric refuses
an optimizer over meta parameters) and are, at stage 3, the sharded ones. An engine's flat layout depends on which
optimizer steps which parameter (a FlatParam holds one optimizer's parameters, in param-group order), so binding
an optimizer later builds a new engine over the same module and parameter objects, taking the weights from the
first one:

- when the new plan keeps every FlatParam's parameters and order (one optimizer over all trainable parameters in
  one group, litgpt's case; or groups in the module's order), each rank reads its own slices from the released
  engine: no communication, no rank ever holds the whole model (a model built sharded stays sharded);
- otherwise (frozen parameters mixed with trainable ones in a unit, param groups out of module order, several
  optimizers) the slices no longer line up, so the first engine gathers the full parameters into the module and
  the new one shards them again: every rank briefly holds the whole model, as it did for a model built eagerly.

Set up the module and optimizers together (``fabric.setup(model, optimizer)``) to shard once.

[Note: a module set up again]
DDP accepts the same module set up a second time: a second wrapper over the same parameters, and either trains
them. Here a module has one engine, so setting it up again returns the forward module of that engine (Fabric wraps
it anew): every wrapper drives the same engine, nothing is gathered or sharded again, and the weights and
optimizer state carry on. Optimizers passed with it are bound as optimizers set up after their module are (above),
which needs the module's optimizers not to have stepped yet: after a step that is refused with the reason, where
DDP would accept it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from zero_strategy.adapter_plumbing.forward_entry import ForwardEntry
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.optimizer import param_owners
from zero_strategy.core.init.materialize import InitialValues
from zero_strategy.fabric.optimizer_class import restore_class
from zero_strategy.initial_values import take_back_released

Build = Callable[[nn.Module, ForwardEntry, list[Optimizer], InitialValues | None], ZeroEngine]


@dataclass(slots=True)
class ShardedModule:
    """One module set up by the strategy: the user's module, the forward module Fabric wraps, and its engine."""

    module: nn.Module
    entry: ForwardEntry
    engine: ZeroEngine


class ShardedModules:
    """Every module the strategy set up, and which engine steps which optimizer."""

    def __init__(self, build: Build, device: Callable[[], torch.device]) -> None:
        self._build = build
        self._device = device
        self.items: list[ShardedModule] = []

    def setup(self, module: nn.Module, optimizers: list[Optimizer], values: InitialValues | None) -> ForwardEntry:
        if any(item.module is module for item in self.items):
            raise ValueError(f"{type(module).__name__} is set up already; set up each module once.")
        entry = ForwardEntry(module)
        self.items.append(ShardedModule(module, entry, self._build(module, entry, optimizers, values)))
        return entry

    def setup_again(self, module: nn.Module, optimizers: list[Optimizer]) -> ForwardEntry:
        """``module`` (or its forward module) is set up already: its forward module, with ``optimizers`` bound (see
        [Note: a module set up again]). Collective when there are optimizers."""
        item = self.find(module)
        for optimizer in optimizers:
            self.bind(optimizer)
        return item.entry

    def find(self, module: nn.Module) -> ShardedModule:
        """The set-up module that is ``module`` or its forward module (what Fabric hands the strategy)."""
        for item in self.items:
            if module is item.entry or module is item.module:
                return item
        raise ValueError(
            f"{type(module).__name__} was not set up by this ZeRO strategy: call fabric.setup(model) or "
            "fabric.setup_module(model) first."
        )

    def holds(self, module: nn.Module) -> bool:
        """Whether ``module`` (or its forward module) was set up by the strategy."""
        return any(module is item.entry or module is item.module for item in self.items)

    def engine_of(self, optimizer: Optimizer) -> ZeroEngine:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper holds the user's optimizer
        for item in self.items:
            if any(candidate is optimizer for candidate in item.engine.optimizers):
                return item.engine
        raise ValueError(
            f"{type(optimizer).__name__} was not set up with this ZeRO strategy: pass it to fabric.setup(model, "
            "optimizer) or fabric.setup_optimizers(optimizer)."
        )

    def bind(self, optimizer: Optimizer) -> None:
        """Bind ``optimizer`` to the engine of the module whose parameters it holds, building that engine anew (see
        [Note: optimizers set up after their module]). Collective."""
        item = self._owner(optimizer)
        old = item.engine
        stepped = [type(o).__name__ for o in old.optimizers if o.state]
        if stepped:
            raise RuntimeError(
                f"{type(optimizer).__name__} is set up after {stepped} already stepped: set up every optimizer of a "
                "module before the first step (fabric.setup_optimizers(opt1, opt2))."
            )
        optimizers = [*old.optimizers, optimizer]
        keep_slices = _same_layout(old, optimizers)
        full = old.release(full=not keep_slices)
        _point_back_at_parameters(old)  # the optimizers held the released engine's master pieces
        device = self._device()
        values = take_back_released(InitialValues(device=device), item.module, None if full else old, device)
        item.engine = self._build(item.module, item.entry, optimizers, values)

    def _owner(self, optimizer: Optimizer) -> ShardedModule:
        held = {id(param) for group in optimizer.param_groups for param in group["params"]}
        owners = [item for item in self.items if held & {id(p) for p in item.module.parameters()}]
        if len(owners) != 1:
            what = "no module set up by this strategy" if not owners else "several modules"
            raise ValueError(
                f"the optimizer's parameters belong to {what}: build each optimizer from one set-up module's "
                "parameters (model = fabric.setup_module(model); optimizer = AdamW(model.parameters()))."
            )
        if any(candidate is optimizer for candidate in owners[0].engine.optimizers):
            raise ValueError("this optimizer is set up already; set up each optimizer once.")
        return owners[0]

    def release_all(self) -> None:
        """Every engine lets its module go (full parameters back, unless a model built sharded at stage 3)."""
        for item in self.items:
            for optimizer in item.engine.optimizers:
                restore_class(optimizer)  # see [Note: zero_grad through Fabric's wrapper]
            item.engine.release()
        self.items = []


def _same_layout(engine: ZeroEngine, optimizers: list[Optimizer]) -> bool:
    """Whether an engine for ``optimizers`` lays every FlatParam of ``engine`` out exactly as it is: each keeps its
    parameters together (one owner, trainable or not), in order (param groups non-decreasing), and no two merge."""
    owner = param_owners(optimizers)
    for unit in engine.units:
        kinds = set()
        for flat in unit.flat_params:
            holders = {tuple(o for o, _ in owner.get(id(p), ())) if p.requires_grad else () for p in flat.params}
            groups = [tuple(g for _, g in owner.get(id(p), ())) for p in flat.params]
            kind = (flat.spec.stored_dtype, flat.spec.compute_dtype, *holders)
            if len(holders) != 1 or groups != sorted(groups) or kind in kinds:
                return False
            kinds.add(kind)
    return True


def _point_back_at_parameters(engine: ZeroEngine) -> None:
    """Give each of ``engine``'s optimizers the module's parameters again, group by group (binding had pointed its
    param groups at the engine's master pieces), so that a new engine binds them afresh. They hold no state yet."""
    for index, optimizer in enumerate(engine.optimizers):
        groups: dict[int, list[nn.Parameter]] = {}
        for flat in engine.flat_params:
            if index in flat.optimizers:
                for param, group_index in zip(flat.params, flat.param_group_in(index), strict=True):
                    groups.setdefault(group_index, []).append(param)
        for position, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = groups.get(position, [])
