"""Gradient maths on master slices: the global norm, per-parameter norms, clipping and the overflow check.

Every rank holds a disjoint slice of every gradient (padding lies in no master piece, so it never counts), so a
global quantity is a local reduction followed by one scalar all-reduce; the answers are the same on every rank,
which is what lets all ranks clip by the same coefficient and skip an overflowing step together. With tensor
parallelism the shard group is the data-parallel group and a second scalar all-reduce crosses the tensor-parallel
group (:class:`AcrossTensorParallel`; see [Note: ZeRO over the data-parallel dimension of a 2-D mesh] in
plan/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zero_strategy.core.comm.comm import Comm, ReduceOp
from zero_strategy.core.flat.flat_param import FlatParam


def _grads(pieces: Iterable[nn.Parameter]) -> list[Tensor]:
    return [p.grad for p in pieces if p.grad is not None]


@dataclass(frozen=True, slots=True)
class AcrossTensorParallel:
    """How a global quantity crosses the tensor-parallel group after the data-parallel one: TP-sharded elements
    count on every TP rank (each holds other blocks), replicated ones on TP rank 0 only (every TP rank holds the
    same values)."""

    comm: Comm  # the tensor-parallel group
    replicated: frozenset[int]  # id() of the master pieces of FlatParams whose parameters TP replicates

    @staticmethod
    def of(flats: Iterable[FlatParam], comm: Comm | None) -> AcrossTensorParallel | None:
        if comm is None:
            return None
        replicated = frozenset(id(piece) for flat in flats if not flat.spec.tensor_sharded
                               for piece in flat.master_pieces)
        return AcrossTensorParallel(comm, replicated)

    def counts(self, piece: nn.Parameter) -> bool:
        """Whether this rank adds ``piece``'s elements to a sum over both dimensions."""
        return self.comm.rank == 0 or id(piece) not in self.replicated


def global_grad_norm(
    pieces: list[nn.Parameter], comm: Comm, norm_type: float = 2.0, tensor: AcrossTensorParallel | None = None
) -> Tensor:
    """The norm of the full gradient across all ranks' slices (``comm``: the shard group; ``tensor``: with tensor
    parallelism, how the tensor-parallel group adds its part). Collective."""
    grads = _grads(pieces)
    # a rank without gradients (or with CPU-offloaded ones) still takes part; the comm moves what is not on the
    # group's device there (see [Note: collectives run on the group's device])
    device = grads[0].device if grads else comm.group.device
    if norm_type == float("inf"):
        local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=device)
        largest = comm.all_reduce(local.float().reshape(1), ReduceOp.MAX, "gradient norm")
        if tensor is not None:
            largest = tensor.comm.all_reduce(largest.wait(), ReduceOp.MAX, "gradient norm across tensor parallel")
        return largest.wait()[0]
    # fp64 accumulation: the sum of squares of millions of fp32 elements loses digits in fp32
    local_sum = torch.zeros(1, dtype=torch.float64, device=device)
    for piece in pieces:
        if piece.grad is not None and (tensor is None or tensor.counts(piece)):
            local_sum += piece.grad.double().abs().pow(norm_type).sum()
    total = comm.all_reduce(local_sum, ReduceOp.SUM, "gradient norm")
    if tensor is not None:
        total = tensor.comm.all_reduce(total.wait(), ReduceOp.SUM, "gradient norm across tensor parallel")
    return total.wait()[0].pow(1.0 / norm_type).float()


def clip_by_global_norm(
    pieces: list[nn.Parameter], comm: Comm, max_norm: float, norm_type: float = 2.0,
    tensor: AcrossTensorParallel | None = None,
) -> Tensor:
    """Scale every slice's gradient so the global norm is at most ``max_norm``; returns the norm before."""
    total = global_grad_norm(pieces, comm, norm_type, tensor)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in _grads(pieces):
        grad.mul_(coefficient.to(grad.dtype))
    return total


def clip_by_value(pieces: list[nn.Parameter], clip_value: float) -> None:
    """Element-wise clipping needs no communication: each element lives on exactly one rank."""
    for grad in _grads(pieces):
        grad.clamp_(-clip_value, clip_value)


def find_overflow(pieces: list[nn.Parameter], comm: Comm, tensor: Comm | None = None) -> bool:
    """True if any rank's (unscaled) gradients hold an inf/NaN. Collective: all ranks agree (``tensor``: with
    tensor parallelism, the tensor-parallel group agrees too)."""
    grads = _grads(pieces)
    found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else comm.group.device)
    for grad in grads:
        found += (~torch.isfinite(grad)).any().float()
    # The one host read of an fp16 step: whether to skip it is a host decision (torch's GradScaler reads its
    # found-inf flag the same way). bf16 and fp32 never get here.
    found = comm.all_reduce(found, ReduceOp.MAX, "overflow check").wait()
    if tensor is not None:
        found = tensor.all_reduce(found, ReduceOp.MAX, "overflow check across tensor parallel").wait()
    return bool(found.item() > 0)


def parameter_grad_norms(
    located: list[tuple[FlatParam, int] | None], comm: Comm, norm_type: float = 2.0,
    tensor: AcrossTensorParallel | None = None,
) -> list[Tensor | None]:
    """Per entry (a parameter as (its FlatParam, its index there), or None), the ``norm_type``-norm of its reduced
    gradient across all ranks' slices, or None where no rank produced a gradient since it was last cleared (DDP's
    ``p.grad`` is None there). One all-reduce of two numbers per parameter. Collective: every rank passes the same
    parameters."""
    if not located:
        return []
    device = comm.group.device
    infinity = norm_type == float("inf")
    parts: dict[int, dict[str, Tensor]] = {}  # id(flat) -> this rank's gradient slices, by parameter name
    local: list[Tensor] = []
    produced: list[float] = []
    for entry in located:
        value = torch.zeros((), dtype=torch.float64, device=device)
        if entry is not None:
            flat, index = entry
            if id(flat) not in parts:
                parts[id(flat)] = _local_grad_parts(flat)
            grad = parts[id(flat)].get(flat.layout.spans[index].name)
            counted = tensor is None or tensor.comm.rank == 0 or flat.spec.tensor_sharded
            if grad is not None and grad.numel() > 0 and counted:
                magnitude = grad.to(device=device, dtype=torch.float64).abs()
                value = magnitude.max() if infinity else magnitude.pow(norm_type).sum()
        local.append(value)
        produced.append(float(entry is not None and entry[0].grads.seen[entry[1]]))
    both = torch.cat([torch.stack(local), torch.tensor(produced, dtype=torch.float64, device=device)])
    op = ReduceOp.MAX if infinity else ReduceOp.SUM
    total = comm.all_reduce(both, op, "per-parameter gradient norms").wait()
    if tensor is not None:  # a TP-sharded parameter's other blocks (replicated ones counted on TP rank 0 only)
        total = tensor.comm.all_reduce(total, op, "per-parameter gradient norms across tensor parallel").wait()
    count = len(located)
    norms = total[:count] if infinity else total[:count].pow(1.0 / norm_type)
    return [norm.float() if used > 0 else None for norm, used in zip(norms, total[count:].tolist(), strict=True)]


def _local_grad_parts(flat: FlatParam) -> dict[str, Tensor]:
    """This rank's elements of each parameter's reduced gradient (parameters whose piece holds none are left out).
    A parameter lies in one master piece: pieces are cut only where param groups change."""
    found: dict[str, Tensor] = {}
    pieces = list(zip(flat.master_pieces, flat.piece_offset, strict=True))
    for overlap in flat.layout.overlaps(flat.rank):
        for piece, offset in pieces:
            if offset <= overlap.shard_start < offset + piece.numel():
                if piece.grad is not None:
                    start = overlap.shard_start - offset
                    found[overlap.name] = piece.grad[start : start + overlap.numel]
                break
    return found


def first_nonfinite_parameter(flats: Iterable[FlatParam], comm: Comm) -> str | None:
    """The first parameter (in flat order, lowest rank first) whose reduced gradient is not finite. Collective."""
    rank = comm.rank
    local: str | None = None
    for flat in flats:
        for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
            if local is None and piece.grad is not None and not bool(torch.isfinite(piece.grad).all()):
                bad = int((~torch.isfinite(piece.grad)).nonzero()[0].item()) + offset
                overlaps = flat.layout.overlaps(rank)
                local = next(o.name for o in overlaps if o.shard_start <= bad < o.shard_start + o.numel)
    names = comm.all_gather_object(local, "first non-finite gradient")
    return next((name for name in names if name is not None), None)
