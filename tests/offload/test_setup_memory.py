"""Setup of a meta-built model at stage 3 holds about this rank's share of the model, never a whole replica: peak
resident memory above the pre-model baseline, per rank, ≤ 4Ψ/N bytes + 2 × the largest unit + 64 MiB (the bound
the README states). Measured in fresh interpreters (see measure_in_fresh_process)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from offload.test_offload import measure_in_fresh_process
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.init import record_construction
from zero_strategy.core.init.materialize import InitialValues
from zero_strategy.process_memory import reset_peak, status_bytes

WIDTH, LAYERS = 2048, 16  # Ψ = 67.1 M fp32 parameters (256 MiB); each Linear (16 MiB) is one unit
MiB = 2**20


def _build() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def peak_setup_rss(rank: int, world: int, meta: bool) -> dict[str, int]:
    """Peak resident bytes above the baseline from building the model to the end of the engine's set-up."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed buffers go back to the system
    baseline = reset_peak()
    torch.manual_seed(0)
    if meta:
        with record_construction() as recording:
            model = _build()
        values = InitialValues(recording)
    else:
        model, values = _build(), None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # its state appears at the first step, not here
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, min_unit_numel=2**20), initial_values=values)
    peak = status_bytes("VmHWM") - baseline
    psi = sum(flat.layout.numel for flat in engine.flat_params)
    largest_unit = max(flat.layout.padded_numel * 4 for flat in engine.flat_params)
    engine.release()
    return {"peak": peak, "psi": psi, "largest_unit": largest_unit}


@pytest.mark.timeout(240)
def test_meta_built_setup_stays_within_one_share_of_the_model() -> None:
    meta = measure_in_fresh_process("test_setup_memory.peak_setup_rss", True)
    print("meta-built setup peak per rank (MiB):", [round(r["peak"] / MiB) for r in meta])
    for rank, r in enumerate(meta):
        bound = 4 * r["psi"] // 2 + 2 * r["largest_unit"] + 64 * MiB
        assert r["peak"] <= bound, f"rank {rank}: setup peak {r['peak'] / MiB:.0f} MiB > {bound / MiB:.0f} MiB"
    # the same model built eagerly holds at least a whole replica per rank: the bound above is not loose enough
    # to let that through
    eager = measure_in_fresh_process("test_setup_memory.peak_setup_rss", False)
    print("eager setup peak per rank (MiB):", [round(r["peak"] / MiB) for r in eager])
    assert all(r["peak"] >= 4 * r["psi"] for r in eager), [r["peak"] / MiB for r in eager]
