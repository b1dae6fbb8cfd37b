"""Each rank's random-number-generator state, as tensors and plain data (no pickle needed to load it).

[Note: every rank's RNG is saved]
A rank's generator states are saved under its position in the run: its rank among every rank of the engine, the
replicas of hybrid sharding included (the engine's ``comms.everyone.rank``). Flat ZeRO: rank r's shard file holds
rank r's states (``rng/torch_cpu``, ``rng/cuda``, and Python's and numpy's as JSON in the metadata under ``rng``).
Hybrid sharding: only the first shard group writes shard files (the replicas hold the same slices), so before
writing, each replica group gathers its ranks' states to its member in the first group, which stores them beside its
own: tensors ``rng/rank-<g>/torch_cpu`` (...) and a JSON map ``{g: plain}`` under ``rng_replicas``. The manifest
does not change. On resume rank g restores what rank g of the saving run saved: with the same layout (world size and
``shard_group_size``) every rank continues exactly where it was; on another layout rank g still restores rank g's
states if the saving run had a rank g, and a rank beyond the saving run's world keeps its own generators (the data
each rank sees differ then anyway). Checkpoints written before replicas' states were saved have none: their replicas
keep their own generators. Readers of that time ignore the extra entries and restore the writers' own.

[Note: one CUDA generator per rank]
A rank computes on one GPU, its current device, so it saves and restores that device's generator only. Saving every
visible device's (``get_rng_state_all``) would make a checkpoint of 8-GPU nodes unloadable where each rank sees one
GPU (one per SLURM task), and would overwrite the generators of devices other ranks own. The state is stored under
``rng/cuda``; older checkpoints stored ``rng/cuda_<index>`` for every visible device, and of those the entry of the
current device's index is restored (the rank's own device when ranks saw the same devices as now)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

CUDA_KEY = "rng/cuda"  # this rank's own device's generator
REPLICAS_METADATA_KEY = "rng_replicas"  # JSON {run rank: plain states} of the replicas a shard file carries
_REPLICA_PREFIX = "rng/rank-"


def replica_prefix(rank: int) -> str:
    """Where a shard file keeps the generator tensors of run rank ``rank``, a replica of the writer."""
    return f"{_REPLICA_PREFIX}{rank}/"


def is_own_entry(name: str) -> bool:
    """A generator tensor of the shard's writer itself (not one it carries for a replica)."""
    return name.startswith("rng/") and not name.startswith(_REPLICA_PREFIX)


def pack_replicas(states: Iterable[tuple[int, dict[str, Tensor], str]]) -> tuple[dict[str, Tensor], str]:
    """(tensors to add to the writer's shard file, the JSON for its ``rng_replicas`` metadata) from replicas'
    ``(run rank, tensors, plain json)`` as :func:`capture_rng` gave them."""
    tensors: dict[str, Tensor] = {}
    plain: dict[str, str] = {}
    for rank, rank_tensors, rank_plain in states:
        for name, tensor in rank_tensors.items():
            tensors[replica_prefix(rank) + name.removeprefix("rng/")] = tensor
        plain[str(rank)] = rank_plain
    return tensors, json.dumps(plain)


def capture_rng() -> tuple[dict[str, Tensor], str]:
    """(tensors, json text): torch CPU and CUDA generators as tensors, Python's and numpy's as JSON."""
    tensors: dict[str, Tensor] = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors[CUDA_KEY] = torch.cuda.get_rng_state(torch.cuda.current_device())
    version, internal, gauss = random.getstate()
    plain: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        plain["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:  # numpy is optional
        pass
    return tensors, json.dumps(plain)


def _restore_cuda(tensors: dict[str, Tensor]) -> None:
    """This rank's CUDA generator, if the checkpoint has one and this process has a GPU (a checkpoint saved on GPU
    ranks resumes on CPU ranks, and the reverse); see [Note: one CUDA generator per rank]."""
    if not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    state = tensors.get(CUDA_KEY, tensors.get(f"rng/cuda_{device}"))
    if state is not None:
        torch.cuda.set_rng_state(state, device)


def restore_rng(tensors: dict[str, Tensor], plain_json: str) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    _restore_cuda(tensors)
    plain = json.loads(plain_json)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in plain:
        import numpy as np

        kind, keys, pos, has_gauss, cached = plain["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
