"""What a read of a stage-3 parameter outside forward returns where DDP would return a view of the parameter (its
``detach()``, an index, a reshape): a copy of its values that refuses writes, so that a change made through it is an
error naming the parameter instead of a change silently lost (see [Note: parameters outside forward] in access.py).
Also the autograd node that stops a gradient from flowing back through such a read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from zero_strategy.core.flat.errors import ShardedParameterError

# Tensor methods that write into their first argument although their name does not end with "_"
IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})


def function_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "")


def is_in_place(func: Callable[..., Any]) -> bool:
    """Whether ``func`` writes into its first tensor argument (``mul_``, ``copy_``, ``nn.init.uniform_``, ``+=``,
    ``p[i] = v``)."""
    name = function_name(func)
    return name in IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))


def written_tensors(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every object ``func(*args, **kwargs)`` writes into: the first argument of an in-place function (a list of
    them for ``torch._foreach_*_``; ``tensor=`` of ``torch.nn.init``'s functions) and ``out=``."""
    targets: list[Any] = []
    if is_in_place(func):
        if getattr(func, "__module__", "") == "torch.nn.init":
            targets.append(kwargs.get("tensor", args[0] if args else None))
        elif args:
            targets.append(args[0])
    if kwargs.get("out") is not None:
        targets.append(kwargs["out"])
    return tree_flatten(targets)[0]


class ValuesCopy(Tensor):
    """A copy of (part of) a stage-3 parameter's values, where DDP would have returned a view of the parameter.
    Reading it is reading a tensor; writing into it (or into a view of it) raises, naming the parameter."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        copies = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, ValuesCopy)]
        written = [t for t in written_tensors(func, args, kwargs) if isinstance(t, ValuesCopy)]
        if written:
            name = written[0].__dict__.get("_zero_name", "a parameter")
            raise ShardedParameterError(
                f"ZeRO stage 3: a write ({function_name(func)}) into a copy of {name}'s values: outside forward a "
                f"view of {name} (its detach(), an index, a reshape) is a copy, so the write would not reach the "
                f"parameter. Write to the parameter itself: `with torch.no_grad(): {name.rsplit('.', 1)[-1]}"
                ".copy_(...)` / `p[i] = v` on every rank (see [Note: parameters outside forward])."
            )
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if not copies:
            return result
        name = copies[0].__dict__.get("_zero_name", "a parameter")
        storages = {_storage_of(t) for t in copies}
        # a view of this copy is a copy of the parameter as well: it refuses writes too
        return tree_map(lambda t: as_values_copy(t, name) if isinstance(t, Tensor) and _storage_of(t) in storages
                        else t, result)


    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved and pickled as the plain tensor it is (a file must not need this package to load)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(Tensor).__reduce_ex__(protocol)


def as_values_copy(value: Tensor, name: str) -> ValuesCopy:
    """``value`` (memory of its own) marked as a copy of parameter ``name``'s values."""
    copy = value.as_subclass(ValuesCopy)
    copy.__dict__["_zero_name"] = name
    return copy  # type: ignore[return-value]


def _storage_of(tensor: Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage().data_ptr()


class NoGradientThrough(torch.autograd.Function):
    """A value read from a stage-3 parameter outside forward, for autograd: it requires a gradient where DDP's
    would, and a backward that reaches it raises (the gradient would have to reach the parameter's shards outside
    the engine's reductions)."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, value: Tensor, name: str) -> Tensor:  # anchor: the edge to the parameter
        ctx.name = name
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        raise ShardedParameterError(
            f"ZeRO stage 3: a gradient reached a value read from {ctx.name} outside forward (e.g. a weight penalty "
            "computed in training_step): compute it inside the module's forward, where the parameter is gathered "
            "and its gradient reduced, or read it under torch.no_grad()."
        )
