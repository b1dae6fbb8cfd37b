"""Tensors a module holds besides its parameters and buffers, made by the recorded build on the meta device.

[Note: attribute tensors]
A build makes tensors that are neither parameters nor buffers: a torchmetrics `Metric` keeps its states as plain
attributes (`add_state`) and their defaults in the `_defaults` dict (what `reset()` goes back to); a module may keep
a plain tensor attribute, or tensors in a list, tuple or dict attribute. Eager, they hold values; built on the meta
device they would stay meta (`Tensor.item() cannot be called on meta tensors` at the first `self.log(metric)`,
`Cannot copy out of meta tensor` in teardown). Replay materializes them with the values an eager build gives, in
place: `torch.utils.swap_tensors` gives the meta tensor *object* its value, so whatever holds it (the attribute,
the list or dict it sits in, user code that kept a reference) sees the value, and containers keep their identity.
Attribute tensors that are views of one storage stay views of one storage. One that is a view of a parameter's storage
is refused: parameters live in flat shards under ZeRO, so no view can follow them. A meta tensor the recording
never saw made (made on the meta device before the build) is left as it is, as an eager build leaves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zero_strategy.core.init.ops import DeferredInitError, TensorRef
from zero_strategy.core.init.record import Recording

_MAX_DEPTH = 4  # containers within containers looked into (a Metric's list state inside `_defaults` is depth 2)


@dataclass(frozen=True, slots=True)
class Place:
    """Where an attribute tensor was found: `holder[key]` (a list or dict) or the attribute `key` of `holder`."""

    holder: Any
    key: Any
    path: str  # for messages: "acc._defaults['tp']"

    def put(self, value: Tensor) -> None:
        if isinstance(self.holder, list | dict):
            self.holder[self.key] = value
        elif isinstance(self.holder, nn.Module):
            vars(self.holder)[self.key] = value  # a plain attribute: no __setattr__ side effects
        else:
            raise DeferredInitError(
                f"{self.path} (in a tuple) is a meta tensor that other tensors are views of, so it cannot be given "
                f"its value in place: hold it in a list or as an attribute, or register it as a buffer."
            )


@dataclass(frozen=True, slots=True)
class AttributeTensor:
    """A recorded meta tensor a module holds outside its parameters and buffers (see [Note: attribute tensors])."""

    tensor: Tensor  # the meta tensor object itself: it is given its value in place
    places: tuple[Place, ...]
    ref: TensorRef

    def fill(self, value: Tensor) -> None:
        """Give the attribute tensor object `value` (a tensor replay made; not written again)."""
        tensor = self.tensor
        if isinstance(tensor, nn.Parameter):  # a parameter no module registered: it stays a Parameter
            replacement: Tensor = nn.Parameter(value, requires_grad=tensor.requires_grad)
        elif type(tensor) is Tensor:
            replacement = value.requires_grad_(tensor.requires_grad)
        else:
            replacement = value.as_subclass(type(tensor))
        if tensor._use_count() == 1:  # type: ignore[attr-defined]
            torch.utils.swap_tensors(tensor, replacement)  # every holder sees the value
            return
        # Another tensor still refers to this one (a view not given its value yet, held where no walk finds it):
        # swap_tensors refuses, so the places it was found in get the value instead.
        for place in self.places:
            place.put(replacement)


def attribute_tensors(module: nn.Module, recording: Recording) -> tuple[AttributeTensor, ...]:
    """Every meta tensor the recording made that `module`'s submodules hold outside parameters and buffers."""
    registered = {id(t): name for name, t in _registered(module)}
    parameter_storage = {
        recording.storage_id(p): name for name, p in module.named_parameters(remove_duplicate=False) if p.is_meta
    }
    internals = set(vars(nn.Module()))  # _parameters, _buffers, _modules, the hook dicts, training, ...
    found: dict[int, tuple[Tensor, list[Place]]] = {}
    for prefix, submodule in module.named_modules():
        for attribute, value in vars(submodule).items():
            if attribute in internals:
                continue
            start = Place(submodule, attribute, f"{prefix}.{attribute}" if prefix else attribute)
            for place, tensor in _tensors_in(value, start, 0, set()):
                if id(tensor) in registered or not tensor.is_meta:
                    continue
                storage = recording.storage_id(tensor)
                if storage is None:
                    continue  # meta before the build began: an eager build leaves it meta too
                if storage in parameter_storage:
                    raise DeferredInitError(
                        f"{place.path} is a view of parameter {parameter_storage[storage]}: ZeRO keeps parameters "
                        f"in flat shards, so a tensor attribute cannot share a parameter's storage. Compute it from "
                        f"the parameter in forward(), or register it as a buffer of its own."
                    )
                found.setdefault(id(tensor), (tensor, []))[1].append(place)
    found_tensors = [AttributeTensor(tensor, tuple(places), recording.ref(tensor)) for tensor, places in found.values()]
    # Views first: a view refers to its base, and swap_tensors gives a value in place only to a tensor nothing
    # else refers to. Once a view has its value, the base is free to get its own.
    return tuple(sorted(found_tensors, key=lambda h: not h.tensor._is_view()))


def _registered(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _tensors_in(value: Any, place: Place, depth: int, visiting: set[int]) -> Iterator[tuple[Place, Tensor]]:
    """Tensors in `value` (found at `place`) and in the lists, tuples and dicts it holds (not inside modules:
    those are walked as submodules, or are not part of this module)."""
    if isinstance(value, Tensor):
        yield place, value
        return
    if depth >= _MAX_DEPTH or id(value) in visiting or not isinstance(value, list | tuple | dict):
        return
    visiting.add(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        yield from _tensors_in(item, Place(value, key, f"{place.path}[{key!r}]"), depth + 1, visiting)
    visiting.discard(id(value))
