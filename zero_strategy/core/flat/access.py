"""A stage-3 parameter outside forward: read and changed as under DDP, never freed memory.

[Note: parameters outside forward]
Between its unit's uses a stage-3 parameter keeps its object, shape and dtype, but its values are on other ranks:
on the network path its storage holds no memory (reading it would read freed memory: garbage, or a crash), and on
one host's CPU it reads a host-wide buffer in place. So that every use gives DDP's answer and every transport
behaves alike, a parameter takes a subclass of its own class while its FlatParam is SHARDED (and its own class back
when the FlatParam is gathered), whose ``__torch_function__`` decides each use (tests/distributed/
test_outside_forward.py tries each kind of read on both transports, test_in_place_changes.py each kind of change):

- what reads no values (shape, dtype, device, ``numel``, ``len``, ``requires_grad``, ``is_leaf``, hooks) answers
  as the parameter does; ``.grad`` reads DDP's value (see [Note: p.grad as under DDP] in
  core/engine/ddp_gradients.py).
- any other read (``clone()``, arithmetic, ``norm()``, ``.tolist()``, ``bool(p)``, ``p.item()``, comparisons,
  ``p.detach()``, ``p[0]``, ``iter(p)``) is computed on the parameter's values (core/flat/outside_forward.py): on
  one host's shared memory in place, with no exchange, so a read only some ranks make (under ``rank_zero_only``)
  simply works; through the network by gathering the parameter's FlatParam for the call and freeing it again: a
  collective, whose gather is labelled "read of <name> outside forward", so that a read only some ranks make
  ends, on every rank, within seconds, in the divergence watch's error naming the parameter and
  ``gathered_parameters()`` (see [Note: diverging gathers] in core/comm/watch.py; the point-to-point transport
  gives these gathers a tag family of their own, so they never pair with a unit's gather). A result never aliases
  the gathered or host-wide buffer: where DDP's would be a view of the parameter (``detach()``, an index, a
  reshape) it is a copy that refuses writes, naming the parameter (core/flat/values_copy.py), so that a change
  through it is an error rather than a change silently lost. A result requires a gradient where DDP's would; a
  backward that reaches it raises (a weight penalty must be computed inside forward, where the parameter's
  gradient is reduced). Cost: through the network each read gathers its unit (Ψ_unit bytes), so a loop reading
  every parameter one by one gathers each unit once per parameter; ``gathered_parameters()`` gathers every unit
  once for a whole block of reads.
- a change in place (``mul_``, ``copy_``, ``p[i] = v``, ``+=``, ``out=p``, ``torch.nn.init``'s functions,
  ``reset_parameters()``) is applied by every rank to a whole copy of the masters: see [Note: in-place changes
  outside the optimizer] in in_place_watch.py. A collective on every transport.
- refused with a :class:`ShardedParameterError` naming the parameter: ``.data`` (a tensor of its own: a change
  through it could not reach the masters; read or change the parameter itself), assigning ``.data``, changes of
  what the parameter is (``set_``, ``resize_``, ``t_``...), and where the values are (``data_ptr()``,
  ``storage_offset()``): on one host an address in the host-wide buffer of every rank's slices, on the network
  path address 0 for every parameter (which code looking for tied weights would take as one shared tensor), under
  DDP the parameter's own; no answer would be DDP's on both.
- ``copy.deepcopy`` (``torch.optim.swa_utils.AveragedModel``, Lightning's ``StochasticWeightAveraging``, EMA
  callbacks copy the module): gathered for the copy, which holds the full values (a collective: every rank copies).
- ``module.state_dict()``: gathered for the duration of the call and every value cloned (engine/
  state_dict_hooks.py; a collective). ``keep_vars=True`` returns the parameters themselves and gathers nothing.
- ``untyped_storage()`` (and ``is_shared()``, which reads it) is let through on purpose, and is the one answer that
  differs between transports: it reports the memory as it is (on one host the mapped host-wide buffer, on the
  network path a freed storage of 0 bytes), which is what memory accounting (``sum(p.untyped_storage().nbytes()
  ...)``, this project's memory tests and benchmarks) must see. It holds no values a user could mistake for DDP's.
- ``repr``/``str`` describe the parameter (name, shape, dtype, "values on other ranks") without its values: a
  debugger or a log line on one rank must not start a collective.
With ``collectives="native"`` on gloo these gathers go point-to-point (core/comm/native.py), and end the same way.
Not covered: on a GPU (NCCL; no watch there) a read only some ranks make is a collective only they make: it can
pair with a peer's gather of the same size (wrong values) or wait until the process group's timeout.
Stages 1 and 2 keep every parameter whole: their parameters are never wrapped. The class swap costs a pointer write
per parameter at each gather and release; inside forward and backward the parameters are their own class, so
nothing is added to the hot path.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from zero_strategy.core.flat.errors import SHARDED_MARKER, ShardedParameterError
from zero_strategy.core.flat.grad_reads import (
    answer_grad_read,
    answer_grad_write,
    is_grad_getter,
    is_grad_setter,
    unwatch_param,
)
from zero_strategy.core.flat.outside_forward import run_outside_forward
from zero_strategy.core.plan.tensor_parallel import is_distributed

__all__ = ["ShardedParameterError", "forget_owner", "mark_owner", "own_grad", "set_own_grad", "unwrap", "wrap"]

# What reads no values of a parameter, and answers alike on every transport and as under DDP: properties (their
# getter's name) and methods. Not here: ``__bool__`` (reads the value of a one-element parameter), ``data_ptr`` and
# ``storage_offset`` (see [Note: parameters outside forward]; ``untyped_storage`` is there on purpose).
_METADATA_PROPERTIES = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "_version", "is_leaf", "is_meta", "is_cuda", "is_cpu",
    "layout", "ndim", "names", "is_sparse", "is_quantized", "is_nested", "grad_fn", "_backward_hooks",
    "_post_accumulate_grad_hooks", "itemsize", "nbytes", "output_nr", "_cdata", "is_mkldnn", "is_xpu", "is_mps",
})
_METADATA_SETTERS = frozenset({"requires_grad", "grad", "_backward_hooks", "_post_accumulate_grad_hooks"})
_METADATA_METHODS = frozenset({
    "numel", "nelement", "size", "dim", "element_size", "untyped_storage", "is_floating_point", "is_complex",
    "stride", "is_contiguous", "get_device", "register_hook",
    "register_post_accumulate_grad_hook", "requires_grad_", "__hash__", "_is_view", "is_shared", "is_pinned",
    "__len__", "__format__", "__repr__", "__dir__", "__sizeof__",
})


def _describe(func: Callable[..., Any]) -> tuple[str, str]:
    """(kind, name) of what ``__torch_function__`` was called for: a property getter/setter or a function."""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__") and owner is not None:
        return name, getattr(owner, "__name__", "")
    return "call", name


def _is_metadata(func: Callable[..., Any]) -> bool:
    kind, name = _describe(func)
    if kind == "__get__":
        return name in _METADATA_PROPERTIES
    if kind == "__set__":
        return name in _METADATA_SETTERS
    return name in _METADATA_METHODS


# What no stage-3 parameter answers outside forward: where its values are (no answer would be DDP's on both
# transports) and ``.data`` (a tensor of its own: writes through it could not reach the masters)
_REFUSED = frozenset({"data", "data_ptr", "storage_offset"})
_KIND = {"__get__": "", "__set__": "assignment", "call": ""}


def _refused(name: str, what: str) -> ShardedParameterError:
    return ShardedParameterError(
        f"ZeRO stage 3: {name} was used ({what}) outside forward, where its values are on other ranks and ZeRO "
        f"owns its storage. Read or change the parameter itself instead (`{name.rsplit('.', 1)[-1]}.clone()`, "
        "`with torch.no_grad(): ....copy_(new)`, on every rank), or use it inside `with "
        "trainer.strategy.gathered_parameters():` (Lightning) / `with engine.gathered_parameters():` (every rank "
        "must enter it: it gathers). See [Note: parameters outside forward]."
    )


class _Sharded:
    """Mixed in before a parameter's own class while its values are elsewhere (see [Note: parameters outside
    forward]); the parameter carries ``_zero_name`` and ``_zero_owner`` (a weak reference to its FlatParam)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_grad_setter(func):  # see [Note: p.grad as under DDP] in core/engine/ddp_gradients.py
            owner = args[0].__dict__.get("_zero_owner")
            answer_grad_write(args[0], owner() if owner is not None else None, args[1])
            return None
        if _is_metadata(func):
            with torch._C.DisableTorchFunctionSubclass():
                value = func(*args, **(kwargs or {}))
            if is_grad_getter(func):  # see [Note: p.grad as under DDP] in core/engine/ddp_gradients.py
                owner = args[0].__dict__.get("_zero_owner")
                return answer_grad_read(args[0], owner() if owner is not None else None, value)
            return value
        kind, name = _describe(func)
        if kind == "__set__" or name in _REFUSED:
            sharded = next((a for a in args if isinstance(a, _Sharded)), None)
            raise _refused(getattr(sharded, "_zero_name", "a parameter"), f"{name} {_KIND[kind]}".strip())
        return run_outside_forward(func, tuple(args), dict(kwargs or {}))

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        owner = self._zero_owner()  # type: ignore[attr-defined]
        if owner is None:
            raise ShardedParameterError(f"{self._zero_name}: its engine is gone")  # type: ignore[attr-defined]
        with owner.gathered():  # collective: every rank copies the module
            assert not isinstance(self, _Sharded), "gathered parameters take their own class back"
            copied = nn.Parameter(self.detach().clone(), requires_grad=self.requires_grad)  # type: ignore[attr-defined]
        memo[id(self)] = copied
        return copied

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(self.shape), self.dtype  # type: ignore[attr-defined]
        return f"ShardedParameter({self._zero_name}, shape={shape}, dtype={dtype}: values on other ranks)"  # type: ignore[attr-defined]

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ShardedParameterError(
            f"{self._zero_name} cannot be pickled outside forward at stage 3 (its values are on other ranks): "  # type: ignore[attr-defined]
            "save with trainer.save_checkpoint / save_sharded, or pickle inside engine.gathered_parameters()."
        )


_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(own: type) -> type:
    """The subclass of ``own`` a parameter of class ``own`` takes while sharded (made once per class)."""
    if own not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[own] = type(f"Sharded{own.__name__}", (_Sharded, own), {SHARDED_MARKER: True})
    return _SHARDED_CLASSES[own]


def own_grad(param: Tensor) -> Tensor | None:
    """``param.grad`` as ZeRO itself reads it: torch's attribute, never answered as a user's read (see [Note: p.grad
    as under DDP] in core/engine/ddp_gradients.py)."""
    with torch._C.DisableTorchFunctionSubclass():
        return param.grad


def set_own_grad(param: Tensor, value: Tensor | None) -> None:
    """Set torch's ``param.grad`` as ZeRO itself does: never taken for a user's assignment (see [Note: p.grad as
    under DDP] in core/engine/ddp_gradients.py)."""
    with torch._C.DisableTorchFunctionSubclass():
        param.grad = value


def mark_owner(param: Tensor, name: str, owner: object) -> None:
    """Remember, on the parameter itself, its name and (weakly) the FlatParam that can gather it."""
    param.__dict__["_zero_name"] = name
    param.__dict__["_zero_owner"] = weakref.ref(owner)


def forget_owner(param: Tensor) -> None:
    """The engine let the parameter go with its full values: it is a plain parameter again, and pickles as one (a
    weak reference cannot be pickled)."""
    param.__dict__.pop("_zero_name", None)
    param.__dict__.pop("_zero_owner", None)


def wrap(params: list[nn.Parameter]) -> None:
    """Their values are going elsewhere: reads outside forward are decided by the subclass (idempotent)."""
    for param in params:
        unwatch_param(param)  # a root parameter still watched for reads of .grad (core/engine/first_use.py)
        # a tensor-parallel parameter keeps its class: a DTensor's dispatch is its class's (see flat_param.py)
        if not isinstance(param, _Sharded) and not is_distributed(param):
            param.__class__ = _sharded_class(type(param))


def unwrap(params: list[nn.Parameter]) -> None:
    """Their values are here again: each parameter takes its own class back (idempotent)."""
    for param in params:
        if isinstance(param, _Sharded):
            param.__class__ = type(param).__mro__[2]  # (Sharded<Own>, _Sharded, <Own>, ...)
