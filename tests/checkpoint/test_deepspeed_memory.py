"""Reading a large DeepSpeed checkpoint maps its files instead of loading them: a rank's ranges cost about what it
reads, not the checkpoint's size. Measured with the kernel's own counters (zero_strategy/process_memory.py) on a
synthetic stage-2 checkpoint this test writes in DeepSpeed's layout (2 ranks, one 16 M-element fp32 parameter with
its Adam moments: 192 MiB of optimizer-state files)."""

from __future__ import annotations

import ctypes
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from deepspeed_files import write_layout

from zero_strategy.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from zero_strategy.process_memory import reset_peak, status_bytes

PER_RANK = 8 * 2**20  # elements of each rank's partition
MIB = 2**20


def _write(root: Path) -> int:
    """The checkpoint's files; returns their total size in bytes."""
    numel = 2 * PER_RANK
    model = {
        "module": OrderedDict(w=torch.zeros(numel, dtype=torch.bfloat16)), "buffer_names": [],
        "param_shapes": [OrderedDict(w=torch.Size([numel]))], "frozen_param_shapes": None, "shared_params": {},
        "global_steps": 7, "lr_scheduler": None, "dp_world_size": 2,
    }
    parts = []
    for rank in range(2):
        values = torch.arange(rank * PER_RANK, (rank + 1) * PER_RANK, dtype=torch.float32)
        parts.append({"optimizer_state_dict": {
            "zero_stage": 2, "partition_count": [2], "single_partition_of_fp32_groups": [values],
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": values + 0.5,
                                                   "exp_avg_sq": values + 0.25}},
                                     "param_groups": [{"lr": 0.1, "params": [0]}]},
        }})
    root = write_layout(root, model, parts)
    return sum(f.stat().st_size for f in root.rglob("*.pt"))


def _reset() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap glibc still holds could hide new allocations
    return reset_peak() / MIB


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak-RSS reset through /proc is Linux-only")
def test_a_ranks_reads_cost_what_it_reads_not_the_checkpoint(tmp_path: Path) -> None:
    """The reads of rank 3 of an 8-rank resume: its 2 M elements of the weights and of both moments (8 MiB each,
    3 reads, 24 MiB), opening the checkpoint included. Allowed: the process's own memory (RssAnon) the bytes read
    + 8 MiB (slack) = 32 MiB: each result is freed before the next read, but inside a long test process glibc may
    keep a freed 8 MiB block rather than reuse it (measured 24.0 MiB in the full suite, 8 MiB alone), so the bound
    is what the reads return, not one read; the peak RSS 2 x one read + 8 MiB plus the mapped pages the reads
    touched, 3 x the bytes read (fault-around) = 96 MiB: under half the 224 MiB of files, which a loader without
    mapping holds whole (shown last, so the probe is seen to count such growth)."""
    size = _write(tmp_path / "ckpt") / MIB
    count = 2 * PER_RANK // 8
    start = 3 * count
    read_mib = count * 4 / MIB
    base, base_anon, anon_growth = _reset(), status_bytes("RssAnon") / MIB, 0.0
    with DeepSpeedCheckpoint(tmp_path / "ckpt") as ckpt:  # opening it counts too: every file is unpickled
        for tensor_of, offset in (("flat", 0.0), ("optim:exp_avg", 0.5), ("optim:exp_avg_sq", 0.25)):
            got = ckpt.read_param("w", tensor_of, start, count)
            anon_growth = max(anon_growth, status_bytes("RssAnon") / MIB - base_anon)
            assert got[0] == start + offset and got[-1] == start + count - 1 + offset
            del got
        growth = status_bytes("VmHWM") / MIB - base
    assert anon_growth <= 3 * read_mib + 8, f"reading 3 x {read_mib:.0f} MiB ranges allocated {anon_growth:.1f} MiB"
    assert growth <= 2 * read_mib + 8 + 3 * 3 * read_mib, f"the reads raised the peak RSS by {growth:.1f} MiB"
    assert growth < size / 2
    base = _reset()
    whole = [torch.load(f, weights_only=True) for f in sorted((tmp_path / "ckpt").rglob("*optim_states.pt"))]
    whole_growth = status_bytes("VmHWM") / MIB - base
    assert whole_growth > 0.9 * 192, "the probe did not see a whole-file load"
    print(f"files {size:.0f} MiB; ranged reads: +{anon_growth:.1f} MiB anon, +{growth:.1f} MiB peak; "
          f"whole load: +{whole_growth:.1f} MiB")
    del whole
