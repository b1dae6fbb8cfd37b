"""What a rank holds: bytes of parameters, gradients and optimizer state, found by walking distinct storages."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor

from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.flat.access import own_grad
from zero_strategy.core.plan.tensor_parallel import local_part


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Per-rank model-state bytes (each storage counted once, whatever views share it)."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def storage_bytes(tensors: Iterable[Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``seen`` lets several calls share one tally)."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def memory_report(engine: ZeroEngine) -> MemoryReport:
    """Bytes of every tensor the engine keeps for the model between steps: parameters (the gathered ``full``
    buffers, the shards, hierarchical stage 3's secondary copies and, with offload to a GPU-less host, the
    device-side compute copies), gradients (the module's ``.grad``, stage 1's fp32 accumulation stash under
    bf16/fp16, the master slices' gradients) and the optimizers' state. Each storage is counted once, whatever
    views share it."""
    seen: set[int] = set()
    param_tensors: list[Tensor] = []
    host_wide = 0
    for flat in engine.flat_params:
        storage = flat.storage
        if storage.full.readable_in_place:  # one buffer per host (see [Note: shared-memory gathers])
            host_wide += storage.full.resident_bytes  # this rank's own slice
            param_tensors.extend([] if storage.shard_aliases_full else [storage.shard])
        else:
            param_tensors.extend([storage.full.tensor, storage.shard])
        if storage.device_source is not None:
            param_tensors.append(storage.device_source)
        if flat.secondary is not None:  # hierarchical stage 3's node-local copy
            param_tensors.append(flat.secondary.values)
    parameters = storage_bytes(param_tensors, seen) + host_wide
    module_grads = [own_grad(p) for flat in engine.flat_params for p in flat.params]
    grad_tensors = [local_part(g) for g in module_grads if g is not None]  # a DTensor's bytes are its block's
    # stage 1 under bf16/fp16 accumulates in fp32 here until the step (see GradientSlices.stash_grad)
    grad_tensors += [flat.grads.stash for flat in engine.flat_params if flat.grads.stash is not None]
    grad_tensors += [p.grad for flat in engine.flat_params for p in flat.master_pieces if p.grad is not None]
    gradients = storage_bytes(grad_tensors, seen)
    state_tensors = [
        value
        for optimizer in engine.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor)
    ]
    return MemoryReport(parameters, gradients, storage_bytes(state_tensors, seen))
