"""Stage 3 on one host's shared memory: a change made in place to a parameter inside forward is refused as it is
made, before it changes anything (see [Note: in-place changes outside the optimizer] in core/flat/in_place_watch.py).

[Note: writes inside forward on shared memory]
There forward reads each unit's parameters in place from a buffer every local rank maps (core/comm/
host_segments.py), and in fp32 each rank's master slice *is* its range of it. A change every rank makes inside
forward (weight-constraint code: ``with torch.no_grad(): self.fc.weight.clamp_(-c, c)`` in a forward or a forward
pre-hook) would land once per rank (x0.25 for a ``mul_(0.5)`` on 2 ranks), in fp32 in the masters themselves, and
no release can undo that. So while such an engine runs forward (from the entry's pre-forward hook to its
post-forward hook, which torch calls even when forward raises; and a recomputation under activation checkpointing,
from a unit's pre-forward hook to its own always-called post hook) a ``TorchFunctionMode`` is on the stack that looks
at every call that writes a tensor: an in-place function (``clamp_``, ``copy_``, ``torch.nn.init``'s), an in-place
dunder (``p[i] = v``, ``+=``), ``out=`` and ``inplace=True``. If the written bytes overlap a host-wide buffer, the
call raises :class:`ShardedParameterError` naming the parameters before it runs. Found by address, so a view
(``p[0]``, ``p.view(-1)``, ``p.detach()``, ``p.data``) is caught like the parameter. With the Trainer the entry is
Lightning's wrapper: the whole ``training_step`` runs under the mode (the LightningModule's own parameters, the root
unit, are in use there; other units' parameters have their sharded class outside their forward and pass).

Let through: ZeRO's own writes (a view of the buffer itself, the optimizers' master pieces: a step or a load made
inside ``training_step``), a stage-3 parameter outside forward (its class applies the change to the masters
exactly; core/flat/outside_forward.py), and anything nested inside a call the mode let through (torch takes the mode
off the stack while it handles a call). Not seen: a write that does not go through a torch function (through numpy,
or a user's backward hook), and one into a tensor-parallel parameter (a DTensor: its local tensor is a view of the
buffer like ZeRO's own). The unit's release still refuses such a change afterwards, from the version counters
(core/flat/master_writes.py), saying the buffer is changed by then.

Only such engines have the mode (stage 3 with ``collectives="auto"`` or ``"shared_memory"`` on one host's CPU ranks,
2 or more): stages 1/2, the network path (whose release takes a change in exactly) and one process never push it,
and ``import zero_strategy`` registers nothing. Cost: one Python call per torch function inside forward (a dict
lookup for whether the function writes); the address check runs only for writes. Measured: 2.8 us per call on top of
torch's 3.7 us (a mode that does nothing adds 2.1 us), 134 calls in a forward of the 5 M benchmark model: about 0.4
ms of its 125 ms CPU time per step, below the benchmark's noise. A forward compiled by ``torch.compile`` is not
checked: dynamo traces the handler as the bare call, so compiled graphs are unchanged (a write there is found at the
release, as above).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zero_strategy.core.flat.errors import ShardedParameterError, is_sharded
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.values_copy import function_name, is_in_place

# in-place by name, but they change no values: a flag, names, or memory that is shared already
_NO_VALUES = frozenset({"requires_grad_", "detach_", "rename_", "share_memory_"})


def _writes_first(func: Callable[..., Any]) -> bool:
    """Whether ``func`` writes into its first tensor argument (or ``tensor=`` of ``torch.nn.init``'s functions)."""
    return is_in_place(func) and function_name(func) not in _NO_VALUES


class ForwardWrites(TorchFunctionMode):
    """The mode of one engine whose FlatParams are host-wide (see [Note: writes inside forward on shared
    memory]); :meth:`enter` and :meth:`exit` nest (the entry's forward, a recomputation inside it)."""

    def __init__(self, flats: list[FlatParam]) -> None:
        super().__init__()
        ranges = []
        for flat in flats:
            full = flat.storage.full.tensor
            start = full.data_ptr()
            ranges.append((start, start + full.numel() * full.element_size(), flat))
        ranges.sort(key=lambda entry: entry[0])
        self._starts = [start for start, _, _ in ranges]
        self._ranges = ranges
        self._writes: dict[Any, bool] = {}  # per function: whether it writes its first argument
        self._depth = 0

    @staticmethod
    def for_flats(flats: list[FlatParam]) -> ForwardWrites | None:
        """The mode for these FlatParams, or None where none is read in place from a host-wide buffer."""
        host_wide = [flat for flat in flats if flat.storage.full.readable_in_place]
        return ForwardWrites(host_wide) if host_wide else None

    def enter(self) -> None:
        if self._depth == 0:
            self.__enter__()
        self._depth += 1

    def exit(self) -> None:
        if self._depth == 0:  # an enter that never happened (its hook raised first)
            return
        self._depth -= 1
        if self._depth == 0:
            stack = torch.overrides._get_current_function_mode_stack()
            if not stack or stack[-1] is not self:  # popping would take another mode off instead of this one
                raise RuntimeError(
                    "ZeRO: a torch function mode entered inside forward was still active when forward returned; "
                    "exit every mode you enter inside forward (use `with`)."
                )
            self.__exit__(None, None, None)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if torch.compiler.is_compiling():  # dynamo traces only the call: a compiled forward is not checked
            return func(*args, **kwargs)
        writes = self._writes.get(func)
        if writes is None:
            writes = self._writes[func] = _writes_first(func)
        if writes or (kwargs and (kwargs.get("out") is not None or kwargs.get("inplace") is True)):
            self._check(func, args, kwargs, writes)
        return func(*args, **kwargs)

    def _check(self, func: Any, args: Any, kwargs: dict[str, Any], writes: bool) -> None:
        targets: list[Any] = []
        if writes:
            nn_init = getattr(func, "__module__", "") == "torch.nn.init"
            targets.append(kwargs.get("tensor", args[0] if args else None) if nn_init else (args[0] if args else None))
        if kwargs.get("out") is not None:
            targets.append(kwargs["out"])
        if kwargs.get("inplace") is True and args:  # torch.nn.functional's relu(x, inplace=True), dropout, ...
            targets.append(args[0])
        for target in tree_flatten(targets)[0]:  # a list for torch._foreach_*_
            if isinstance(target, Tensor) and not is_sharded(target):  # sharded: its class applies the change
                self._refuse_if_host_wide(func, target)

    def _refuse_if_host_wide(self, func: Any, target: Tensor) -> None:
        try:
            with torch._C.DisableTorchFunctionSubclass():
                lo, hi = _byte_extent(target)
        except RuntimeError:  # no storage of its own (a wrapper subclass): not memory of a host-wide buffer
            return
        if hi <= lo:
            return
        position = bisect.bisect_right(self._starts, hi - 1) - 1  # the last buffer starting before the write ends
        if position < 0:
            return
        start, end, flat = self._ranges[position]
        if lo >= end or _engine_handle(flat, target):
            return
        item = flat.storage.full.tensor.element_size()
        first, last = (max(lo, start) - start) // item, (min(hi, end) - start - 1) // item
        names = [name for name, span in zip(flat.names, flat.layout.spans, strict=True)
                 if span.offset <= last and first < span.end] or [flat.label]
        raise ShardedParameterError(
            f"ZeRO stage 3: {', '.join(names)} changed in place ({function_name(func)}) inside forward (with the "
            "Trainer: anywhere in training_step, where the LightningModule's own parameters are in use), refused "
            "before it changed anything: on one host's shared memory forward reads the parameters in place from one "
            "buffer per host, where a change every rank makes would land once per rank (x0.25 for a mul_(0.5) on 2 "
            "ranks). Make the change outside forward (on every rank, `with torch.no_grad(): ...`) or inside "
            "`gathered_parameters()` (every rank enters it): ZeRO then applies it to the masters exactly. See "
            "[Note: writes inside forward on shared memory]."
        )


def _byte_extent(tensor: Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` a tensor's elements lie in (a strided view: from its first to its last element)."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    lo = tensor.data_ptr()
    return lo, lo + (last + 1) * tensor.element_size()


def _engine_handle(flat: FlatParam, target: Tensor) -> bool:
    """Whether ``target`` is ZeRO's own handle on the buffer, not a parameter's: a view of the buffer itself (the
    engine's writes: a load, a release after ``gathered_parameters()``) or a master piece (an optimizer step made
    inside forward; a write into a master piece is this rank's own slice, exact)."""
    full = flat.storage.full.tensor
    root = full._base if full._base is not None else full
    base = target._base if target._base is not None else target
    return base is root or any(target is piece for piece in flat.master_pieces)
