"""The benchmark's DeepSpeed rows (``deepspeed_zero1/2/3``): DeepSpeed ZeRO on the same CPU ranks as the others.

Only registered where DeepSpeed is installed (:data:`benchmarks.bench_methods.BUILDERS`); this module
imports it in the rank process, after ``DS_ACCELERATOR=cpu`` is set, so that it takes the CPU accelerator and
the gloo process group that ``run_ranks`` already initialised.

[Note: how DeepSpeed is configured]
fp32, one micro-batch per step, no clipping, the caller's torch AdamW (``zero_allow_untested_optimizer``), and
DeepSpeed's defaults for everything else, so the rows show DeepSpeed as users run it. The defaults that shape
what is measured:
- ``reduce_bucket_size`` (default 5e8 elements) is the one we change, to Ψ. With the default, every model the
  benchmark runs (Ψ ≤ 30 M) fits one gradient bucket, and so it still does; what changes is the buffer: stage 3
  keeps a 5e8-element fp32 bucket (1.86 GiB of ``torch.empty``) for the whole run, of which CPU pages only the
  first Ψ elements ever become resident. The model-state walk counts storages, so it would report 1.86 GiB of
  gradients that are not there. A Ψ-element bucket is what the default leaves resident, and the same traffic
  (measured: stage 3, 5m preset, RSS after four steps 331 MiB with the default, 362 MiB with Ψ, allocator noise).
  ``allgather_bucket_size`` (also 5e8) stays: the parameter all-gather allocates by the partition, not by it.
- ``use_multi_rank_bucket_allreduce`` (stages 1/2, default on): gradients are all-reduced, not reduce-scattered,
  so stages 1 and 2 send 2Ψ + Ψ (the parameter all-gather after the step): 1.5x the 2Ψ of the ZeRO paper.
- ``stage3_param_persistence_threshold`` (1e5 elements) and ``stage3_max_reuse_distance`` (1e9): parameters
  below 1e5 elements are never released, and the others stay gathered from forward to backward, so stage 3
  all-gathers Ψ once per step (2Ψ with the reduce-scatter, below the 3Ψ theory) and holds more parameters.
- fp32 master weights: DeepSpeed clones this rank's partition of the parameters even when they already are fp32,
  so every stage holds 4Ψ/N more than the 16Ψ-family theory (4Ψ + 16Ψ/N for stages 1/2, 20Ψ/N + the
  persistent and bucket tensors for stage 3). Stage 1 also keeps only this rank's gradient partition after
  backward (4Ψ/N, not the 4Ψ of the theory), exactly as stage 2.
- ``train_micro_batch_size_per_gpu`` is the preset's batch per rank: a builder is not told ``--batch``, and
  DeepSpeed uses the value only for bookkeeping (the batch-size check, its throughput timer and sample counter),
  never in the arithmetic, as we call the engine's forward, backward and step ourselves with one micro-batch.

[Note: what is counted for DeepSpeed]
Traffic: DeepSpeed's collectives go through ``deepspeed.comm``, which calls ``torch.distributed.<function>`` at
call time, except the all-gather / reduce-scatter functions that its backend captures when
``deepspeed.initialize`` creates it; the counter's wrappers are installed before that, so the captured ones are
the wrappers. Enumerating every collective entry point of ``torch.distributed`` and ``distributed_c10d`` during a
step (DeepSpeed 0.19.8, each stage) found only ``all_reduce``, ``all_gather_into_tensor`` and
``reduce_scatter_tensor``, which the counter already wraps, and their bytes add up to the 3Ψ / 3Ψ / 2Ψ above;
the wrappers installed here (``reduce``, the list forms, the coalesced forms, and ``distributed_c10d``'s
names) make a DeepSpeed code path that uses them count too instead of vanishing from the row.
Model state: :func:`walk_deepspeed_state` (see there) replaces the generic walk, which sees neither DeepSpeed's
gradient partitions nor its bucket.
Peak RSS: the benchmark's baseline is taken before a method is built, so the DeepSpeed rows include importing
and initialising DeepSpeed itself: about 80 MiB per rank on this project's CPU machine, whatever the model size.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor, nn

from benchmarks.bench_counter import LEARNING_RATE, CollectiveCounter, MethodRun, SizeOf
from benchmarks.bench_model import PRESETS, BenchGPT, parameter_count


def _sum_nbytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# Entry points beyond the counter's own table that a DeepSpeed code path may use, under the counter's convention
# (an all-reduce counts twice its buffer; a reduce, gather or scatter its full buffer once).
_DEEPSPEED_EXTRA: dict[str, tuple[str, SizeOf]] = {
    "reduce": ("reduce", lambda a, k: _sum_nbytes([a[0] if a else k["tensor"]])),
    "all_gather": ("all_gather", lambda a, k: _sum_nbytes(a[0] if a else k["tensor_list"])),
    "reduce_scatter": ("reduce_scatter", lambda a, k: _sum_nbytes(a[1] if len(a) > 1 else k["input_list"])),
    "all_reduce_coalesced": ("all_reduce", lambda a, k: 2 * _sum_nbytes(a[0] if a else k["tensors"])),
    "_all_gather_base": ("all_gather", lambda a, k: _sum_nbytes([a[0] if a else k["output_tensor"]])),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _sum_nbytes([a[1] if len(a) > 1 else k["input"]])),
}


def count_deepspeed_collectives(counter: CollectiveCounter) -> None:
    """Wrap the extra entry points, in ``torch.distributed`` and in ``distributed_c10d`` (DeepSpeed's coalesced
    all-gather calls the latter's functions). Must run before ``deepspeed.initialize``: see the module's Note."""
    counter.install(dist, _DEEPSPEED_EXTRA)
    counter.install(c10d)  # the counter's own table, reached through the other module
    counter.install(c10d, _DEEPSPEED_EXTRA)


def deepspeed_config(stage: int, micro_batch: int, psi: int) -> dict[str, Any]:
    """The DeepSpeed config of one row; see [Note: how DeepSpeed is configured]."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # none, as for every other method
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_allow_untested_optimizer": True,  # a torch AdamW, the same optimizer as the other rows
        "zero_optimization": {"stage": stage, "reduce_bucket_size": psi},
    }


def preset_micro_batch(model: nn.Module) -> int:
    """The batch per rank of the preset whose shape ``model`` has (1 for a model of no preset)."""
    assert isinstance(model, BenchGPT)
    for shape in PRESETS.values():
        if (
            model.tok_emb.num_embeddings == shape.vocab_size
            and model.tok_emb.embedding_dim == shape.width
            and model.pos_emb.num_embeddings == shape.max_seq
            and len(model.blocks) == shape.n_layer
        ):
            return shape.batch
    return 1


def _import_deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed first picks its accelerator
    deepspeed = importlib.import_module("deepspeed")
    # Its INFO lines (the whole config, per rank) would interleave with the benchmark's report.
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def _set_launcher_environment() -> None:
    """What the ``deepspeed`` launcher would export, which ``deepspeed.initialize`` asserts (one machine: the local
    rank is the rank)."""
    rank = str(dist.get_rank())
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", str(dist.get_world_size()))):
        os.environ.setdefault(name, value)


def build_deepspeed(stage: int, model: nn.Module, counter: CollectiveCounter) -> MethodRun:
    """DeepSpeed ZeRO ``stage`` on this rank of the already initialised gloo group."""
    count_deepspeed_collectives(counter)
    _set_launcher_environment()
    deepspeed = _import_deepspeed()
    config = deepspeed_config(stage, preset_micro_batch(model), parameter_count(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    # Its setup prints (a CPU op it builds on first use) go to stderr, with the benchmark's progress lines, so
    # that stdout stays the report.
    with contextlib.redirect_stdout(sys.stderr):
        engine, zero_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return MethodRun(
        forward_module=engine,
        module=model,
        optimizer=zero_optimizer,  # its zero_grad clears DeepSpeed's gradient buffers too
        step=engine.step,
        state_optimizer=zero_optimizer.optimizer,  # the AdamW, now over this rank's fp32 partition
        backward=engine.backward,
        state_walk=functools.partial(walk_deepspeed_state, model, zero_optimizer),
    )


def _children(path: str, obj: object) -> Iterator[tuple[str, object]]:
    """What the walk descends into: containers, and the attributes of DeepSpeed's own objects (not modules, not
    the wrapped torch optimizer, which are walked on their own, nor torch's process groups and the like)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            name = key if isinstance(key, str | int | torch.dtype) else type(key).__name__  # no tensor's repr
            yield f"{path}[key]", key
            yield f"{path}[{name}]", value
    elif isinstance(obj, list | tuple | set | frozenset):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value
    elif isinstance(obj, Tensor):
        yield f"{path}.grad", obj.grad
    elif type(obj).__module__.startswith("deepspeed") and not isinstance(obj, nn.Module) and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            yield f"{path}.{name}", value


def reachable_tensors(root: object) -> Iterator[tuple[str, Tensor]]:
    """Every tensor reachable from ``root`` through :func:`_children`, with the path it was first reached by."""
    stack: list[tuple[str, object]] = [("", root)]
    visited: set[int] = set()
    while stack:
        path, obj = stack.pop()
        if obj is None or id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, Tensor):
            yield path, obj
        stack.extend(reversed(list(_children(path, obj))))


class _StorageTally:
    """Bytes of distinct storages, each counted once, in the first category it is offered to."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, tensors: list[Tensor]) -> int:
        total = 0
        for tensor in tensors:
            if tensor.device.type == "meta":  # DeepSpeed keeps shape-only meta copies; they hold no memory
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def walk_deepspeed_state(model: nn.Module, zero_optimizer: Any) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes on this rank, each storage once, in this order:

    - parameters: the model's parameter storages (stages 1/2: DeepSpeed's flat buffer that they are views of;
      stage 3: whatever is gathered or persistent) and stage 3's ``ds_tensor`` partitions;
    - optimizer state: the AdamW's ``state`` and the fp32 master partition it steps (``param_groups``), which
      the ZeRO paper counts with the optimizer state;
    - the rest of what is reachable from DeepSpeed's ZeRO optimizer object: gradients where the path names a
      gradient or the gradient bucket (``averaged_gradients``, ``grad_partitions_flat_buffer``, ``ipg_buckets``,
      ``.grad``), otherwise optimizer state (what is left there is a few scalars, bytes in all).

    Listed for DeepSpeed 0.19.8 by enumerating what this walk reaches: stages 1/2 hold the flat parameters,
    ``averaged_gradients`` and the fp32 master partition; stage 3 the persistent parameters, ``ds_tensor``
    partitions, ``grad_partitions_flat_buffer``, ``ipg_buckets`` and ``fp32_partitioned_groups_flat``.
    """
    tally = _StorageTally()
    with torch.no_grad():
        parameters = list(model.parameters())
        partitions = [getattr(p, "ds_tensor", None) for p in parameters]  # stage 3's slice of each parameter
        param_bytes = tally.add(parameters + [t for t in partitions if isinstance(t, Tensor)])
        inner = zero_optimizer.optimizer
        masters = [p for group in inner.param_groups for p in group["params"]]
        moments = [v for state in inner.state.values() for v in state.values() if isinstance(v, Tensor)]
        optim_bytes = tally.add(masters + moments)
        grads = [p.grad for p in parameters + masters if p.grad is not None]
        others: list[Tensor] = []
        for path, tensor in reachable_tensors(zero_optimizer):
            (grads if "grad" in path or "ipg" in path else others).append(tensor)
        grad_bytes = tally.add(grads)
        optim_bytes += tally.add(others)
    return param_bytes, grad_bytes, optim_bytes
