"""Ranks started by "spawn" or "forkserver" get their own copy of every tensor the module holds.

[Note: tensors shared by spawn]
``torch.multiprocessing`` pickles a CPU tensor as a handle to shared memory. Every rank a multiprocessing launcher
starts with "spawn" or "forkserver" therefore receives the *same* storage for each tensor of the module it was
handed, and so does the main process. Lightning copies parameters and buffers, and only for "spawn". Everything
else a module holds stays shared: a torchmetrics metric's states (plain tensor attributes, not buffers), any tensor
attribute of the user's, and with "forkserver" the parameters and buffers too. The ranks then update one tensor
together: a metric counts every rank's batches, concurrent ``+=`` lose updates under load (a perplexity that is no
longer exp(loss), now and then), and the main process's module is changed behind its back for the next ``fit``
or ``validate``.

So a rank copies, first thing, every tensor of the module tree that lives in shared memory: parameters and
buffers in place (``.data``, so optimizers and hooks keep the same ``Parameter`` objects), other tensor
attributes, and tensors inside a list, tuple or dict attribute (a torchmetrics "cat" state). A tensor reached
twice is copied once, so tied attributes stay tied. Views of one another become separate tensors, as with
Lightning's own copy. A "fork" start needs none of this: its pages are copied on write. Only host tensors are
copied (see ``_in_shared_host_memory``), and only tensors the module reaches through its attributes and plain
containers: a tensor inside some other object stays shared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

SHARING_START_METHODS = ("spawn", "forkserver")
_MODULE_REGISTRIES = ("_parameters", "_buffers", "_modules")


@torch.no_grad()
def make_module_tensors_private(root: nn.Module) -> int:
    """Replace every shared-memory tensor held by ``root``'s modules with a private copy; how many were copied."""
    # keyed by the id of the tensor object found, kept alive in the value so that no id is reused meanwhile
    copies: dict[int, tuple[Tensor, Tensor]] = {}

    def private(tensor: Tensor) -> Tensor:
        if id(tensor) not in copies:
            copies[id(tensor)] = (tensor, tensor.detach().clone())
        return copies[id(tensor)][1]

    for tensor in (*root.parameters(), *root.buffers()):
        if _in_shared_host_memory(tensor):
            tensor.data = private(tensor)
    for module in root.modules():
        for name, value in list(vars(module).items()):
            if name in _MODULE_REGISTRIES:
                continue
            replaced = _private_value(value, private)
            if replaced is not value:
                # straight into __dict__: a module's __setattr__ may route tensors elsewhere (buffers, metric states)
                module.__dict__[name] = replaced
    return len(copies)


def _in_shared_host_memory(tensor: Tensor) -> bool:
    # A CUDA tensor always reports is_shared() (it crossed by IPC handle); the strategy's move to this rank's device
    # copies it anyway, and copying it here would first duplicate it on the device it came from.
    return tensor.device.type == "cpu" and tensor.is_shared()


def _private_value(value: Any, private: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with its shared tensors copied (a list or dict is updated in place, a tuple rebuilt)."""
    if isinstance(value, Tensor):
        if not _in_shared_host_memory(value):
            return value
        if isinstance(value, nn.Parameter):  # one the module does not register: keep the object, copy its data
            value.data = private(value)
            return value
        return private(value)
    if isinstance(value, list):
        for index, item in enumerate(value):
            value[index] = _private_value(item, private)
        return value
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _private_value(item, private)
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = tuple(_private_value(item, private) for item in value)
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value
