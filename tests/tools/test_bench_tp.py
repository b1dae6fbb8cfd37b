"""``python -m benchmarks.bench_tp`` on the 34 M Llama, 2 DP x 2 TP ranks, read from the printed table: the README's
bound (zero3_p2p against ModelParallelStrategy) and the ``mps`` row's walked model state against the arithmetic of
FSDP2 over TP shards: each of the 4 ranks holds a quarter of every Linear and Embedding weight (split over both mesh
dimensions) and half of every norm weight (replicated over TP, sharded over DP), fp32, and AdamW's two moments of
each. Both tests read one run of the benchmark (two fresh interpreters forking 4 ranks each)."""

from __future__ import annotations

import contextlib
import io

import pytest
from helpers.bench_report import table_rows
from helpers.tp_llama import build_llama

from benchmarks.bench_tp import SIZES, main, table

MiB = 2**20


@pytest.fixture(scope="module")
def report() -> str:
    """The README's measurement: ``--size 34m --methods mps,zero3_p2p --steps 2`` (the default 4 samples per
    data-parallel rank); the report is what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report = main(["--size", "34m", "--methods", "mps,zero3_p2p", "--steps", "2"])
    assert report in printed.getvalue()
    return report


# Each timeout covers the benchmark's run if its test is the first to use `report` (~80 s measured on a quiet
# machine).
@pytest.mark.timeout(400)
def test_model_parallel_row_holds_a_quarter_of_the_model_state(report: str) -> None:
    rows = table_rows(report)
    assert list(rows) == ["mps", "zero3_p2p"], rows
    cells = rows["mps"]
    held = sum(p.numel() / (2 if name.endswith("norm.weight") else 4)
               for name, p in build_llama(SIZES["34m"]).named_parameters())
    assert float(cells[3]) == pytest.approx(4 * held / MiB, abs=0.006)  # params MiB, two decimals printed
    assert float(cells[5]) == pytest.approx(8 * held / MiB, abs=0.006)  # AdamW: exp_avg + exp_avg_sq
    assert float(cells[1]) > 0 and cells[7] == "1.00x" and cells[8] == "1.00x"


def test_a_failed_method_prints_n_a_and_its_error() -> None:
    ranks = [{"peak": 100 * MiB, "walk": (10 * MiB, 10 * MiB, 20 * MiB)} for _ in range(4)]
    report = table({"mps": ranks, "zero3": "TypeError: unexpected keyword 'tensor_parallel_size'"})
    rows = table_rows(report)
    assert rows["zero3"][1:] == ["n/a"] * 8
    assert "zero3: n/a, TypeError: unexpected keyword 'tensor_parallel_size'" in report


@pytest.mark.timeout(400)
def test_zero3_on_the_network_path_peaks_no_higher_than_model_parallel_strategy(report: str) -> None:
    """The README's bound (docs/tensor-parallel.md, "Memory"): ZeRO-3 x TP's peak resident memory per rank, on the
    path GPUs and several nodes take (each rank gathers one unit at a time), does not exceed ModelParallelStrategy's
    on the same 34 M Llama; its parameters + optimizer state are no larger."""
    rows = table_rows(report)
    peak_ratio = float(rows["zero3_p2p"][7].removesuffix("x"))
    state_ratio = float(rows["zero3_p2p"][8].removesuffix("x"))
    assert peak_ratio <= 1.0, report
    assert state_ratio <= 1.0, report
