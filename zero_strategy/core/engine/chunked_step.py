"""The optimizer step over master slices that live in files (nvme offload), a few chunks at a time (see [Note: nvme
offload] in core/flat/placement.py)."""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.core.flat.placement import NvmeStore


def _is_elementwise(value: object, param: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape == param.shape


def chunked_step(optimizer: Optimizer, chunk_numel: int, store: NvmeStore) -> None:
    """Run ``optimizer.step()`` over its master pieces, at most ``chunk_numel`` elements per call.

    Each call hands the optimizer views of a few chunks of pieces (and views of their states), so the update is
    exactly the whole-tensor one for element-wise optimizers, and only those chunks' pages are resident before
    they are released again. New state tensors (first step) are moved into files; scalar state (Adam's ``step``)
    advances once per step, not once per chunk.
    """
    pieces = [list(group["params"]) for group in optimizer.param_groups]
    saved = optimizer.state
    # Each chunk starts from the state as it was before this step (a piece's first step starts from nothing);
    # element-wise tensors in it are file-backed and updated in place through their chunk views.
    before = {piece: dict(saved[piece]) for group in pieces for piece in group if piece in saved}
    scalars: dict[Tensor, dict[str, object]] = {}
    try:
        for round_chunks in _pack_chunks(pieces, chunk_numel):
            state_views: dict[Tensor, dict[str, object]] = {}
            owners: list[tuple[nn.Parameter, nn.Parameter, int]] = []
            for group in optimizer.param_groups:
                group["params"] = []
            for group_index, piece, lo, hi in round_chunks:
                view = nn.Parameter(piece.data[lo:hi])
                view.grad = piece.grad[lo:hi] if piece.grad is not None else None
                old = before.get(piece, {})
                state_views[view] = {k: (v[lo:hi] if _is_elementwise(v, piece) else _copy(v)) for k, v in old.items()}
                optimizer.param_groups[group_index]["params"].append(view)
                owners.append((piece, view, lo))
            optimizer.state = defaultdict(dict, state_views)
            grads = [view.grad for _, view, _ in owners if view.grad is not None]
            store.populate([view.data for _, view, _ in owners] + grads + [
                value for state in state_views.values() for value in state.values()
                if isinstance(value, Tensor) and value.dim() > 0
            ])  # fmt: skip
            optimizer.step()
            for piece, view, start in owners:
                name = f"state-{id(optimizer)}-{id(piece)}"  # two optimizers stepping one piece: two files
                _store_chunk_state(saved, piece, optimizer.state[view], start, (store, name), scalars)
            store.release_pages()
    finally:
        optimizer.state = saved
        for group, group_pieces in zip(optimizer.param_groups, pieces, strict=True):
            group["params"] = group_pieces
    for owner, values in scalars.items():
        saved[owner].update(values)


def _pack_chunks(pieces: list[list[nn.Parameter]], chunk_numel: int) -> list[list[tuple[int, nn.Parameter, int, int]]]:
    """(group, piece, start, end) chunks of every piece with a gradient, packed into rounds of at most
    ``chunk_numel`` elements."""
    rounds: list[list[tuple[int, nn.Parameter, int, int]]] = [[]]
    filled = 0
    for group_index, group in enumerate(pieces):
        for piece in group:
            if piece.grad is None:
                continue
            for lo in range(0, piece.numel(), chunk_numel):
                hi = min(lo + chunk_numel, piece.numel())
                if filled + hi - lo > chunk_numel and rounds[-1]:
                    rounds.append([])
                    filled = 0
                rounds[-1].append((group_index, piece, lo, hi))
                filled += hi - lo
    return [r for r in rounds if r]


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, Tensor) else value


def _store_chunk_state(
    saved: dict, piece: nn.Parameter, new: dict[str, object], start: int, files: tuple[NvmeStore, str],
    scalars: dict,
) -> None:
    """Write one chunk's updated state back into the piece's file-backed state (``files``: the store and the
    name prefix of this optimizer's files for this piece)."""
    store, prefix = files
    state = saved.setdefault(piece, {})
    for key, value in new.items():
        if isinstance(value, Tensor) and value.dim() > 0:
            if key not in state:
                state[key] = store.tensor(f"{prefix}-{key}", piece.numel(), value.dtype).view_as(piece)
            target = state[key].reshape(-1)[start : start + value.numel()]
            if target.data_ptr() != value.data_ptr():
                target.copy_(value.reshape(-1))
        elif start == 0:  # scalar state: every chunk advanced its own copy; keep the first chunk's
            scalars.setdefault(piece, {})[key] = value
