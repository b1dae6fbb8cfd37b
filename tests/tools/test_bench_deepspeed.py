"""The benchmark's DeepSpeed rows, end to end on the tiny preset (skipped where DeepSpeed is not installed).

Checks what the rows claim: DeepSpeed trains the same model to the same losses as DDP, the counter sees its
collectives, and the model-state walk finds its partitions and buffers. DeepSpeed holds more than the ZeRO paper's
16Ψ family (see [Note: how DeepSpeed is configured] in ``benchmarks.bench_deepspeed``), so the state is
held to DeepSpeed's own layout; its ratio to the shared theory is what the table prints.

The first DeepSpeed run on a machine builds its CPU shared-memory op (about a minute, cached afterwards).
"""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator
pytest.importorskip("deepspeed")

from helpers.bench_report import table_rows

from benchmarks.benchmark import main

WORLD = 2  # the benchmark's default number of ranks
# The tiny preset's parameters are all under stage3_param_persistence_threshold (1e5 elements): never released.
DEEPSPEED_STATE_PER_PSI = {
    1: 4 + 16 / WORLD,  # parameters 4; gradient partition, fp32 master partition 4 each, moments 8, all /N
    2: 4 + 16 / WORLD,
    3: 4 + 4 + 20 / WORLD,  # persistent parameters 4, gradient bucket 4; partitions of all five (4+4+4+8) /N
}
TRAFFIC_TO_THEORY = {1: 1.5, 2: 1.5, 3: 2 / 3}  # all-reduce 2Ψ + all-gather Ψ; all-gather Ψ + reduce-scatter Ψ


def _details(report: str, method: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(f"- {method}: "))


@pytest.mark.timeout(180)  # under 60 s once DeepSpeed's op is built; see the module docstring
def test_deepspeed_rows_match_ddp_and_deepspeeds_layout() -> None:
    methods = ["ddp"] + [f"deepspeed_zero{stage}" for stage in (1, 2, 3)]
    report = main(["--params", "tiny", "--reps", "1", "--steps", "2", "--methods", ",".join(methods)])

    rows = table_rows(report)
    assert sorted(rows) == sorted(methods)
    for stage in (1, 2, 3):
        method = f"deepspeed_zero{stage}"
        cells = rows[method]
        assert "n/a" not in cells[1], f"{method} failed: {cells[1]}"
        details = _details(report, method)

        loss_gap = float(re.search(r"max \|loss - DDP loss\| over steps (\S+)", details).group(1))
        assert loss_gap < 1e-3, details  # fp32, same data and AdamW: only the reduction order differs

        params, grads, optim = (
            float(x) for x in re.search(r"params (\S+), grads (\S+), optimizer (\S+);", details).groups()
        )
        assert grads > 0 and optim > 0, f"the walk missed DeepSpeed's buffers: {details}"
        # 5%: on this tiny model DeepSpeed's gradient partition holds whole tensors (2.28 bytes/Ψ, not 2.00)
        assert abs((params + grads + optim) / DEEPSPEED_STATE_PER_PSI[stage] - 1) < 0.05, details

        traffic = float(re.search(r"\(([\d.]+)x theory\)", cells[6]).group(1))
        assert traffic == pytest.approx(TRAFFIC_TO_THEORY[stage], abs=0.01), cells[6]
