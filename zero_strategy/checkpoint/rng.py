"""Each rank's random-number-generator state, as tensors and plain data (no pickle needed to load it)."""

from __future__ import annotations

import json
import random
from typing import Any

import torch
from torch import Tensor


def capture_rng() -> tuple[dict[str, Tensor], str]:
    """(tensors, json text): torch CPU and CUDA generators as tensors, Python's and numpy's as JSON."""
    tensors: dict[str, Tensor] = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda_{index}"] = state
    version, internal, gauss = random.getstate()
    plain: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        plain["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:  # numpy is optional
        pass
    return tensors, json.dumps(plain)


def restore_rng(tensors: dict[str, Tensor], plain_json: str) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("rng/cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    plain = json.loads(plain_json)
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in plain:
        import numpy as np

        kind, keys, pos, has_gauss, cached = plain["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
