"""Set-up and training peaks per rank and the largest-model search (``zero_strategy.estimate.fit``), and their
``zero-estimate`` flags.

Expected set-up bytes are derived by hand from what ``core/flat/storage.py`` allocates (the reasoning is in each
assertion's comment); the family's counts are checked against the benchmark's real module on the meta device; the
search against a linear scan. The measured side (peak RSS of real runs) is ``benchmarks/bench_largest.py``, smoke-
tested in test_bench_largest.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.bench_model import BenchGPT, ModelShape
from zero_strategy.estimate.fit import GPTFamily, Machine, compare_peaks, largest_fitting, training_peak
from zero_strategy.estimate.memory import CONFIGURATIONS, describe_model, estimate_memory

REPO = Path(__file__).resolve().parents[2]
WIDTH, LAYERS = 512, 6  # each Linear is one unit (min_unit_numel below): Ψ and every unit divide by 2 ranks
GiB = 2**30


def _linears() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _peaks(precision: str = "32-true", meta_init: bool = True, compute_device: str = "cpu") -> dict:
    peaks = compare_peaks(_linears(), world_size=2, precision=precision, meta_init=meta_init,
                          compute_device=compute_device, min_unit_numel=WIDTH * WIDTH)  # fmt: skip
    return dict(zip(CONFIGURATIONS, peaks, strict=True))


@pytest.mark.timeout(30)
def test_setup_peak_is_what_the_engine_allocates():
    psi, unit, tensor = LAYERS * (WIDTH * WIDTH + WIDTH), WIDTH * WIDTH + WIDTH, WIDTH * WIDTH
    meta, eager = _peaks(), _peaks(meta_init=False)
    # stage 3 built on meta: the fp32 slices (4Ψ/N) and the one tensor the replay holds
    assert meta[3, "none", "none"].setup.device == 4 * psi // 2 + 4 * tensor
    # stages 1/2 keep `full` (4Ψ) and the slices alias it; plus the replay's tensor
    assert meta[1, "none", "none"].setup.device == meta[2, "none", "none"].setup.device == 4 * psi + 4 * tensor
    # built eagerly, stage 3 holds every unit whole until set-up ends (4Ψ) besides the slices, and one unit's
    # new buffer beside the module's own tensor it replaces
    assert eager[3, "none", "none"].setup.device == 4 * psi + 4 * psi // 2 + 4 * unit
    assert eager[1, "none", "none"].setup.device == 4 * psi + 4 * unit
    # offloaded slices are host memory (cpu) or resident file pages (nvme) during set-up
    for offload in (("cpu", "none"), ("nvme", "nvme")):
        assert meta[(3, *offload)].setup.host == 4 * psi // 2 and meta[(3, *offload)].setup.device == 4 * tensor
    # mixed precision, stages 1/2: bf16 `full` (2Ψ), fp32 slices apart, one unit converted at a time (fp32 + bf16)
    bf16 = _peaks("bf16-mixed")
    assert bf16[2, "none", "none"].setup.device == 2 * psi + 4 * psi // 2 + 6 * unit
    # on a GPU, stage 3 with offloaded masters keeps a compute-dtype copy of the slices on the device
    gpu = _peaks(compute_device="cuda")
    assert gpu[3, "cpu", "none"].setup.device == 4 * tensor + 4 * psi // 2
    assert gpu[3, "cpu", "cpu"].setup.device == 4 * tensor


@pytest.mark.timeout(30)
def test_training_peak_with_nvme_is_the_larger_phase_with_the_first_steps_state():
    e = estimate_memory(_linears(), world_size=2, stage=3, offload_optimizer="nvme", offload_param="nvme",
                        compute_device="cpu", min_unit_numel=WIDTH * WIDTH, nvme_chunk_numel=4096)  # fmt: skip
    chunk = 4096  # elements stepped at once; AdamW: fp32 master, gradient, 2 states in files + 2 new ones in memory
    assert e.gradients.host == 0
    step = chunk * (4 + 4 + 8 + 8)
    compute = e.parameters.device + e.communication.device
    peaks = compare_peaks(_linears(), world_size=2, compute_device="cpu", min_unit_numel=WIDTH * WIDTH,
                          nvme_chunk_numel=4096)[CONFIGURATIONS.index((3, "nvme", "nvme"))]  # fmt: skip
    assert peaks.training_ram(compute_on_host=True) == max(step, compute)
    peak = training_peak(e)
    assert peak.nvme == e.total.nvme == 16 * e.num_params // 2  # masters, gradients, AdamW state: this rank's slice
    plain = estimate_memory(_linears(), world_size=2, stage=3, compute_device="cpu", min_unit_numel=WIDTH * WIDTH)
    assert training_peak(plain) == plain.total


@pytest.mark.timeout(30)
def test_gpt_family_counts_are_the_benchmark_models():
    family = GPTFamily(width_per_layer=16, vocab=300, max_seq=40)
    for layers in (1, 2, 5):
        gpt = family.member(layers)
        with torch.device("meta"):
            model = BenchGPT(ModelShape(gpt.vocab, gpt.max_seq, gpt.width, layers, 2, 1, 8))
        shape = describe_model(model)  # each block a unit; the embeddings are below the threshold: in the root
        assert gpt.num_params == sum(p.numel() for p in model.parameters()) == shape.num_params
        assert gpt.root == sum(f.numel for f in shape.root) and gpt.block == sum(f.numel for f in shape.largest)
        assert gpt.largest_tensor == max(p.numel() for p in model.parameters())


@pytest.mark.timeout(60)
def test_largest_model_fits_and_the_next_does_not():
    machine = Machine(ram=24 * GiB, disk=60 * GiB, ranks_per_node=2)
    family = GPTFamily(width_per_layer=64, vocab=8192, max_seq=128)
    results = largest_fitting(machine, world_size=2, family=family)
    for config, result in zip(CONFIGURATIONS, results, strict=True):
        assert result.shape is not None and result.peaks is not None, config
        index = CONFIGURATIONS.index(config)
        fits = [machine.fits(compare_peaks(family.member(n), world_size=2, compute_device="cpu")[index])
                for n in range(1, result.shape.n_layer + 2)]  # fmt: skip
        assert all(fits[:-1]) and not fits[-1], (config, result.shape.n_layer)
        # the budget: 2 ranks within 85 % of the RAM
        assert 2 * result.peaks.ram(compute_on_host=True) <= 0.85 * 24 * GiB
    nvme = results[CONFIGURATIONS.index((3, "nvme", "nvme"))]
    zero3 = results[CONFIGURATIONS.index((3, "none", "none"))]
    assert nvme.shape.num_params > 2 * zero3.shape.num_params  # the files hold 12 of the 16 bytes per parameter
    # the disk bounds nvme: with too little disk the largest shrinks
    small_disk = largest_fitting(Machine(ram=24 * GiB, disk=2 * GiB, ranks_per_node=2), world_size=2, family=family)
    assert small_disk[CONFIGURATIONS.index((3, "nvme", "nvme"))].shape.n_layer < nvme.shape.n_layer
    # a bare count: the largest fits, one more parameter does not
    count = largest_fitting(machine, world_size=2)[CONFIGURATIONS.index((3, "none", "none"))]
    psi = count.peaks.estimate.num_params
    assert machine.fits(compare_peaks(psi, world_size=2, compute_device="cpu")[2])
    assert not machine.fits(compare_peaks(psi + 1, world_size=2, compute_device="cpu")[2])


def test_machine_and_family_refuse_bad_input():
    with pytest.raises(ValueError, match=r"ram= .* or device_memory="):
        Machine(disk=1e9)
    with pytest.raises(ValueError, match="headroom"):
        Machine(ram=1e9, headroom=1.5)
    with pytest.raises(ValueError, match="positive"):
        GPTFamily(width_per_layer=0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "zero_strategy.estimate", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=50, cwd=REPO)


@pytest.mark.timeout(60)
def test_cli_reports_peaks_and_the_largest_model(capsys):
    from zero_strategy.estimate.cli import main

    done = _cli("--largest", "--family", "gpt", "--family-kwargs", '{"vocab": 8192, "max_seq": 128}',
                "--world-size", "2", "--ram", "24GiB", "--disk", "60GiB")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "B params (" in line]
    assert len(lines) == len(CONFIGURATIONS) and "15% headroom" in done.stdout
    for argv, message in (
        (["--largest", "--world-size", "2"], "--ram"),
        (["--largest", "--ram", "24GB", "--model", "torch.nn:Identity"], "--family gpt"),
        ([], "--params or --model"),
        (["--largest", "--ram", "24GB", "--family", "bert"], "unknown model family"),
    ):
        with pytest.raises(SystemExit, match=message):
            main(argv)
    table = {}
    for flag in ("--meta-init", "--no-meta-init"):
        assert main(["--params", "1B", "--world-size", "2", "--ram", "24GB", flag]) == 0
        out = capsys.readouterr().out
        rows = [re.split(r"\s{2,}", line) for line in out.split("Set-up and training peak")[1].splitlines()]
        row = next(cells for cells in rows if cells[0] == "zero3")
        table[flag] = float(row[1])  # set-up bytes on the compute device (here: RAM), GiB
    # built eagerly every rank also holds a whole replica (4Ψ = 3.73 GiB) during set-up
    assert 3.6 < table["--no-meta-init"] - table["--meta-init"] < 3.9


@pytest.mark.timeout(30)
def test_cpu_ranks_see_the_shared_memory_case_and_the_network_fallback(capsys):
    """On CPU ranks "auto" prefers shared memory, but a full /dev/shm makes the run gather through the network (it
    warns): the report shows both tables, and --collectives point_to_point only the second. The figures are the
    estimator's, held to measured bytes per case in tests/tools/test_estimate.py."""
    from zero_strategy.estimate.cli import main

    def zero3_train_ram(out: str, table: int) -> float:
        block = out.split("Set-up and training peak")[table]
        rows = [re.split(r"\s{2,}", line.strip()) for line in block.splitlines()]
        return float(next(cells for cells in rows if cells[0] == "zero3")[3])

    assert main(["--params", "1B", "--world-size", "2", "--ram", "24GB"]) == 0
    both = capsys.readouterr().out
    assert "If /dev/shm lacks room" in both and both.count("Set-up and training peak") == 2
    shared, network = zero3_train_ram(both, 1), zero3_train_ram(both, 2)
    assert network > shared  # each rank holds the units it gathers instead of its slice of a shared buffer
    assert main(["--params", "1B", "--world-size", "2", "--ram", "24GB", "--collectives", "point_to_point"]) == 0
    only = capsys.readouterr().out
    assert only.count("Set-up and training peak") == 1 and zero3_train_ram(only, 1) == network
    assert main(["--params", "1B", "--world-size", "2", "--device-memory", "80GB"]) == 0
    assert "If /dev/shm lacks room" not in capsys.readouterr().out  # GPUs never gather through shared memory
