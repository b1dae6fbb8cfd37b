"""Pretrained weights at engine level: each rank of an engine build with ``pretrained=`` reads its share of the file,
counted by the kernel (the reader-level ranged reads are tested in test_pretrained.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.init import record_construction
from zero_strategy.initial_values import initial_values
from zero_strategy.testing import run_ranks

READ_WIDTH, READ_LAYERS = 1024, 4  # 16 MiB of fp32 weights; each Linear is one unit
KiB = 1024


def _wide_stack() -> nn.Module:
    return nn.Sequential(*(nn.Linear(READ_WIDTH, READ_WIDTH) for _ in range(READ_LAYERS)))


def _bytes_read_so_far() -> int:
    """What this process has passed through read()/pread() calls so far, from the page cache or not: the kernel's
    ``rchar`` (/proc/self/io), whoever made the calls. (gloo receives with recv, which it does not count.)"""
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))


def pretrained_build_worker(rank: int, world: int, path: str) -> tuple[int, dict[str, Tensor]]:
    """A meta-built model sharded at stage 3 with ``pretrained=path``, as ZeroStrategy does it; the bytes this
    rank read meanwhile, and the loaded values."""
    torch.manual_seed(0)
    with record_construction() as recording:
        model = _wide_stack()
    config = ZeroConfig(stage=3, min_unit_numel=READ_WIDTH * READ_WIDTH, pretrained=path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _bytes_read_so_far()
    with initial_values(model, recording, config, torch.device("cpu")) as values:
        engine = ZeroEngine(model, [optimizer], config, initial_values=values)
    read = _bytes_read_so_far() - before
    with engine.gathered_parameters():
        loaded = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return read, loaded


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io is Linux-only")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_engine_build_with_pretrained_reads_its_share_of_the_file(tmp_path, world):
    """Each rank of an engine build with ``pretrained=`` (a 16 MiB safetensors file) reads 1/N of the tensors'
    bytes, plus the header (read when the file is opened and matched) and a few KiB of other small files — counted
    by the kernel, not by the reader — and the model gets the file's values."""
    torch.manual_seed(1)
    weights = {key: value.detach().clone() for key, value in _wide_stack().state_dict().items()}
    path = tmp_path / "w.safetensors"
    save_file(weights, path)
    data = sum(t.numel() * t.element_size() for t in weights.values())
    header = path.stat().st_size - data  # the 8-byte length and the JSON header
    for rank, (read, loaded) in enumerate(run_ranks(pretrained_build_worker, world, str(path), timeout_s=100)):
        assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], v) for k, v in weights.items()), rank
        share = data / world  # every unit (1024 x 1024 + 1024 elements) divides evenly by 2 and 4
        assert share <= read <= share + 4 * header + 64 * KiB, (
            f"rank {rank} of {world} read {read} bytes of a {data}-byte model: expected {share:.0f} + headers"
        )
