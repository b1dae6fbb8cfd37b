"""Each rank's random-number-generator state, as tensors and plain data (no pickle needed to load it).

[Note: one CUDA generator per rank]
A rank computes on one GPU, its current device, so it saves and restores that device's generator only. Saving every
visible device's (``get_rng_state_all``) would make a checkpoint of 8-GPU nodes unloadable where each rank sees one
GPU (one per SLURM task), and would overwrite the generators of devices other ranks own. The state is stored under
``rng/cuda``; older checkpoints stored ``rng/cuda_<index>`` for every visible device, and of those the entry of the
current device's index is restored (the rank's own device when ranks saw the same devices as now)."""

from __future__ import annotations

import json
import random
from typing import Any

import torch
from torch import Tensor

CUDA_KEY = "rng/cuda"  # this rank's own device's generator


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
