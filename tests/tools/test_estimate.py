"""The memory estimator against what real runs hold, and the ``zero-estimate`` command line.

Predictions are held to bytes MEASURED on 2 gloo ranks after real steps of the engine: storages walked here
(tests/helpers/storage.py, independent of the code under test) and ``memory_report(engine)``. Each quantity is
taken where the estimate says it peaks: parameters + master slices during the second step's forward/backward
(prefetch only starts once the first forward recorded the unit order), gradients right after backward (stage 1
still holds them full-size then), optimizer state after the step.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from helpers.models import lm_loss, make_batches, make_model, rank_slice
from helpers.storage import StorageTally, host_shared_storages, optimizer_state_tensors
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import memory_report
from zero_strategy.core.flat.access import own_grad
from zero_strategy.estimate import (
    CONFIGURATIONS,
    OPTIMIZER_STATE_BYTES,
    compare,
    estimate_memory,
    measure_activation_bytes,
    smallest_fitting,
)
from zero_strategy.estimate.fit import GPTFamily, Machine, ModelFacts, compare_peaks, model_facts
from zero_strategy.estimate.memory import guess_unit_numel
from zero_strategy.lightning.precision import ZeroPrecision
from zero_strategy.testing import run_ranks

MODEL = {"vocab": 63, "width": 47, "n_blocks": 4}  # root unit (embedding, final norm) + 4 blocks, odd: padded
WORLD = 2
TOLERANCE = 0.001  # the README states "within 0.1 %": byte counts are deterministic, so the bound is exact
RUNS = [(stage, precision, "none") for precision in ("32-true", "bf16-mixed") for stage in (1, 2, 3)]
OFFLOAD_RUNS = [(1, "32-true", "cpu"), (3, "bf16-mixed", "cpu")]
# Stage 3 gathering through the network (collectives="point_to_point", or "auto" with /dev/shm full): each rank
# holds the units it gathers in its own memory, and reduces without the shared arenas
NETWORK_RUNS = [(3, "32-true", "none"), (3, "bf16-mixed", "none")]
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------- measuring
def _model_state_bytes(engine: ZeroEngine) -> int:
    """Every storage a FlatParam owns: compute copies (``full``; a buffer the host's ranks share counts 1/N),
    master slices, device copies of offloaded ones."""
    tensors = [flat.full for flat in engine.flat_params] + [flat.shard for flat in engine.flat_params]
    tensors += [flat.storage.device_source for flat in engine.flat_params]
    return StorageTally(host_shared_storages(engine)).bytes_of(tensors)


def _gradient_bytes(engine: ZeroEngine) -> int:
    """Module ``.grad``, the stage-1 fp32 stash (memory_report does not see it) and the master slices' ``.grad``."""
    tensors = [own_grad(p) for flat in engine.flat_params for p in flat.params]  # torch's, not a read
    tensors += [flat.grads.stash for flat in engine.flat_params]
    tensors += [piece.grad for flat in engine.flat_params for piece in flat.master_pieces]
    return StorageTally().bytes_of(tensors)


def _offload_split(engine: ZeroEngine, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the buffers the engine placed through its offload placement (masters, their gradients, optimizer
    state), with the device they really are on, and how many device copies of the slices the engine made."""
    placed = [flat.shard for flat in engine.flat_params]
    placed += [piece.grad for flat in engine.flat_params for piece in flat.master_pieces]
    placed += optimizer_state_tensors(optimizer, min_numel=2)
    return {
        "host": StorageTally().bytes_of(placed),
        "host_on_cpu": int(all(t.device.type == "cpu" for t in placed if t is not None)),
        "device_copies": sum(flat.storage.device_source is not None for flat in engine.flat_params),
    }


def _train_and_measure(
    rank: int, world: int, stage: int, precision: str, offload: str, collectives: str = "auto"
) -> dict[str, object]:
    model = make_model(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = ZeroPrecision(precision)
    config = ZeroConfig(stage=stage, offload_optimizer=offload, collectives=collectives)
    engine = ZeroEngine(model, [optimizer], config, policy=plugin.policy())
    autocast = torch.autocast("cpu", dtype=plugin.compute_dtype) if precision != "32-true" else nullcontext()
    peak = [0, 0]  # every FlatParam storage; the compute copies alone

    def sample(tensor: torch.Tensor) -> torch.Tensor:  # called inside every op of forward and backward
        peak[0] = max(peak[0], _model_state_bytes(engine))
        peak[1] = max(peak[1], StorageTally(host_shared_storages(engine)).bytes_of(f.full for f in engine.flat_params))
        return tensor

    out: dict[str, object] = {}
    for step, (tokens,) in enumerate(make_batches(2, 1, 8, vocab=MODEL["vocab"])):
        optimizer.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(sample, sample) if step == 1 else nullcontext():
            with autocast:
                loss = lm_loss(model, rank_slice(tokens, rank, world))
            loss.backward()
        out["gradients"] = _gradient_bytes(engine)
        engine.optimizer_step(optimizer)
    report = memory_report(engine)
    out.update(params_peak=peak[0], full_peak=peak[1])
    out["report"] = (report.parameters, report.gradients, report.optimizer_state)
    out["optimizer_state"] = StorageTally().bytes_of(optimizer_state_tensors(optimizer))
    out["split"] = _offload_split(engine, optimizer)
    return out


def _measure_all(rank: int, world: int) -> dict[tuple, dict[str, object]]:
    measured: dict[tuple, dict[str, object]] = {}
    for run in RUNS + OFFLOAD_RUNS:
        measured[run] = _train_and_measure(rank, world, *run)
    for run in NETWORK_RUNS:
        measured[("network", *run)] = _train_and_measure(rank, world, *run, collectives="point_to_point")
    return measured


@pytest.fixture(scope="module")
def measured() -> dict[tuple[int, str, str], dict[str, object]]:
    """Rank 0's measurements of every run (one pair of forked ranks for all of them)."""
    return run_ranks(_measure_all, WORLD, timeout_s=50)[0]


def _predict(stage: int, precision: str, offload: str = "none", collectives: str = "auto"):
    return estimate_memory(make_model(**MODEL), world_size=WORLD, stage=stage, precision=precision,
                           offload_optimizer=offload, compute_device="cpu", collectives=collectives)  # fmt: skip


def comparison_rows(measured: dict) -> list[tuple[str, str, int, int]]:
    """(configuration, quantity, measured bytes, predicted bytes) for every run and quantity compared."""
    rows = []
    for run in RUNS:
        got, e = measured[run], _predict(*run)
        # stages 1/2 keep `full`; stage 3 on one host's CPUs without offload (every run here) keeps its own slice of
        # each shared buffer, which is then what the estimate's parameters are, at rest as at the peak
        at_rest = e.master.total + e.parameters.total
        name = f"zero{run[0]} {run[1]}"
        rows += [
            (name, "parameters+master (peak in fwd/bwd)", got["params_peak"], e.parameters.total + e.master.total),
            (name, "parameters+master at rest (memory_report)", got["report"][0], at_rest),
            (name, "gradients (after backward)", got["gradients"], e.gradients.total),
            (name, "optimizer state (memory_report)", got["report"][2], e.optimizer_state.total),
            (name, "optimizer state (own walk)", got["optimizer_state"], e.optimizer_state.total),
        ]
    for run in NETWORK_RUNS:
        got, e = measured[("network", *run)], _predict(*run, collectives="point_to_point")
        name = f"zero{run[0]} {run[1]} network"
        rows += [  # the units whole at the peak: root, the one computing and the prefetched one
            (name, "parameters+master (peak in fwd/bwd)", got["params_peak"], e.parameters.total + e.master.total),
            (name, "gradients (after backward)", got["gradients"], e.gradients.total),
            (name, "optimizer state (own walk)", got["optimizer_state"], e.optimizer_state.total),
        ]
    return rows


def format_rows(rows: list[tuple[str, str, int, int]]) -> str:
    lines = [f"{'configuration':<26} {'quantity':<42} {'measured':>9} {'predicted':>9} {'ratio':>6}"]
    lines += [f"{c:<26} {q:<42} {m:>9} {p:>9} {m / p:>6.3f}" for c, q, m, p in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- tests
@pytest.mark.timeout(60)
def test_predictions_match_measured_bytes_within_a_tenth_of_a_percent(measured):
    rows = comparison_rows(measured)
    print("\n" + format_rows(rows))
    bad = [row for row in rows if abs(row[2] - row[3]) > TOLERANCE * row[3]]
    assert not bad, "off by more than 0.1%:\n" + format_rows(bad)
    # the engine's own report and the independent walk agree on the optimizer state
    assert all(measured[run]["report"][2] == measured[run]["optimizer_state"] for run in RUNS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("run", OFFLOAD_RUNS, ids=lambda run: f"zero{run[0]}-{run[1]}-offload")
def test_offload_split_is_reported_where_the_code_places_it(measured, run):
    split = measured[run]["split"]
    e = _predict(*run)
    # masters, gradient slices and optimizer state: host memory, nothing of them on the device
    assert e.master.device == e.optimizer_state.device == 0 and e.master.host > 0 and e.optimizer_state.host > 0
    assert split["host_on_cpu"] == 1
    predicted_host = e.master.host + e.optimizer_state.host + (e.gradients.host if run[0] >= 2 else e.master.host)
    assert abs(split["host"] - predicted_host) <= TOLERANCE * predicted_host, (split, predicted_host)
    # the compute copies stay on the device (at stage 3 only while a step runs); on a CPU no extra device copy of
    # the slices is made ...
    device = measured[run]["full_peak"]
    assert abs(device - e.parameters.device) <= TOLERANCE * e.parameters.device, (device, e.parameters)
    assert split["device_copies"] == 0
    # ... on a GPU the estimate adds that compute-dtype copy (cΨ/N) on the device
    on_gpu = estimate_memory(make_model(**MODEL), world_size=WORLD, stage=run[0], precision=run[1],
                             offload_optimizer="cpu")  # fmt: skip
    compute_bytes = 4 if run[1] == "32-true" else 2
    extra = on_gpu.parameters.device - e.parameters.device
    assert 0.8 * compute_bytes * e.num_params / WORLD <= extra <= 1.1 * compute_bytes * e.num_params / WORLD


@pytest.mark.timeout(30)
def test_paper_arithmetic_and_where_the_code_differs():
    psi, n = 65e9, 8
    est = {(s, p): estimate_memory(psi, world_size=n, stage=s, precision=p) for s in (1, 2, 3)
           for p in ("32-true", "bf16-mixed")}  # fmt: skip
    fp32_1, bf16_1, bf16_2, bf16_3 = est[1, "32-true"], est[1, "bf16-mixed"], est[2, "bf16-mixed"], est[3, "bf16-mixed"]
    near = lambda got, want: abs(got - want) <= 0.001 * want  # noqa: E731
    assert near(fp32_1.parameters.device, 4 * psi) and fp32_1.master.total == 0  # the master aliases its slice
    assert near(bf16_1.parameters.device, 2 * psi) and near(bf16_1.master.device, 4 * psi / n)
    assert near(bf16_1.gradients.device, 4 * psi)  # fp32 stash, where the paper has 2Ψ
    assert near(bf16_2.gradients.device, 4 * psi / n) and near(bf16_3.gradients.device, 4 * psi / n)
    assert near(bf16_3.master.device, 4 * psi / n) and bf16_3.parameters.device < 0.1 * psi
    for e in est.values():
        assert near(e.optimizer_state.device, 8 * psi / n)
    nvme = estimate_memory(psi, world_size=n, stage=3, precision="bf16-mixed", offload_optimizer="nvme",
                           offload_param="nvme")  # fmt: skip
    assert nvme.master.device == nvme.optimizer_state.device == nvme.gradients.device == 0
    assert near(nvme.master.nvme + nvme.optimizer_state.nvme, 12 * psi / n)
    assert near(nvme.gradients.nvme, 4 * psi / n) and nvme.gradients.host == 0  # gradient slices in a file
    assert nvme.optimizer_state.host < 0.01 * psi  # one chunk resident
    assert estimate_memory(psi, world_size=n, stage=2, optimizer="sgd-no-momentum").optimizer_state.total == 0


@pytest.mark.timeout(30)
def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(ValueError, match="lamb") as info:
        estimate_memory(1e6, world_size=2, stage=2, optimizer="lamb")
    for name in OPTIMIZER_STATE_BYTES:
        assert name in str(info.value)


@pytest.mark.timeout(30)
def test_compare_and_smallest_fitting_prefer_no_offload_and_lower_stage():
    estimates = compare(65e9, world_size=8, precision="bf16-mixed")
    assert [(e.stage, e.offload_optimizer, e.offload_param) for e in estimates] == list(CONFIGURATIONS)
    best = smallest_fitting(65e9, 80e9, world_size=8, precision="bf16-mixed")
    assert best is not None and (best.stage, best.offload_optimizer, best.offload_param) == (3, "cpu", "none")
    assert smallest_fitting(1e9, 80e9, world_size=8, precision="bf16-mixed").label == "zero1"
    assert smallest_fitting(1e12, 80e9, world_size=2) is None


@pytest.mark.timeout(30)
def test_activations_are_the_storages_saved_for_backward():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    batch = torch.randn(8, 32)
    # saved: the input of the first Linear and the ReLU output (also the second Linear's input); weights excluded
    assert measure_activation_bytes(model, batch) == 4 * 8 * (32 + 64)
    assert measure_activation_bytes(model, batch, "bf16-mixed") == 2 * 8 * (32 + 64)
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())  # model left as it was
    e = estimate_memory(model, world_size=2, stage=2, sample_batch=batch)
    assert e.activations.device == 4 * 8 * (32 + 64) and e.total.device > e.activations.device


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "zero_strategy.estimate", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=50, cwd=REPO)


@pytest.mark.timeout(60)
def test_cli_prints_every_configuration_and_the_smallest_that_fits():
    done = _cli("--params", "7e9", "--world-size", "8", "--device-memory", "80GB")
    assert done.returncode == 0, done.stderr
    for stage, opt, par in CONFIGURATIONS:
        label = " ".join([f"zero{stage}"] + [f"{w}→{d}" for w, d in (("opt", opt), ("param", par)) if d != "none"])
        assert any(line.startswith(label + " ") for line in done.stdout.splitlines()), label
    assert "Smallest that fits" in done.stdout


@pytest.mark.timeout(30)
def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    from zero_strategy.estimate.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        main(["--params", "7e9", "--plot", str(tmp_path / "chart.png")])


@pytest.mark.timeout(30)
def test_plot_draws_one_bar_per_configuration(tmp_path):
    pytest.importorskip("matplotlib")
    from zero_strategy.estimate.cli import main

    chart = tmp_path / "chart.png"
    assert main(["--params", "7e9", "--world-size", "8", "--device-memory", "80GB", "--plot", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(30)
def test_console_script_points_at_main():
    text = (REPO / "pyproject.toml").read_text()  # (tomllib is not in Python 3.10, which we support)
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'zero-estimate = "zero_strategy.estimate.cli:main"' in scripts.splitlines()


def test_cli_predicts_bytes_per_link_for_flat_hybrid_and_hierarchical(capsys):
    """``--nodes``: per-link bytes and time per step; the hybrid layout keeps gathers inside the nodes (the figures
    themselves are held to measured bytes in tests/distributed/test_hybrid_sharding.py)."""
    from zero_strategy.estimate.cli import main

    main(["--params", "1e9", "--nodes", "2", "--gpus-per-node", "4", "--inter-gbps", "8", "--intra-gbps", "800"])
    out = capsys.readouterr().out
    stage3 = out[out.index("stage 3,") :].splitlines()
    flat = [float(x) for x in stage3[2].split()[1:]]
    hybrid = [float(x) for x in stage3[3].split()[2:]]
    assert stage3[3].startswith("hybrid K=4")
    # flat: 3 exchanges of 4 GB, 4 of 7 peers remote, 1/8 each: 6 GB across nodes; hybrid: 2·(1 GB)/2 = 1 GB
    assert flat[1] == pytest.approx(6e9 / 2**30, abs=1e-3) and hybrid[1] == pytest.approx(1e9 / 2**30, abs=1e-3)
    assert hybrid[2] < flat[2]  # less time: the slow link carries less
    # hierarchical: one world gather and the reduce-scatter cross (2 × 4 GB × 4/8 = 4 GB); the backward gather
    # stays inside the node (4 GB / 4 to each of 3 peers) beside the world exchanges' 3/8 of 8 GB
    assert stage3[4].startswith("hierarchical K=4")
    hierarchical = [float(x) for x in stage3[4].split()[2:]]
    assert hierarchical[1] == pytest.approx(4e9 / 2**30, abs=1e-3)
    assert hierarchical[0] == pytest.approx(6e9 / 2**30, abs=1e-3)


# ------------------------------------------------------------------------------------------ tensor parallel
@pytest.mark.timeout(30)
def test_tensor_parallel_shards_each_ranks_part_over_world_over_k():
    """``tensor_parallel=K``: each rank holds Ψ_local = Ψ·(1 - f) + Ψ·f/K (f = 1 for a bare count), and ZeRO shards
    that over world/K ranks: the paper's figures with Ψ_local and N = world/K (see [Note: which parameters the
    estimate takes as tensor-parallel] in zero_strategy/estimate/tensor_parallel.py)."""
    psi, world, k = 65e9, 16, 2
    near = lambda got, want: abs(got - want) <= 0.001 * want  # noqa: E731
    for fraction, local in ((None, psi / k), (0.5, psi * 0.5 + psi * 0.5 / k), (0.0, psi)):
        options = {"tensor_parallel": k, "tp_fraction": fraction, "precision": "bf16-mixed"}
        s1, s3 = (estimate_memory(psi, world_size=world, stage=s, **options) for s in (1, 3))
        n = world // k
        assert s1.num_params == round(local) and s1.tensor_parallel == k and s1.world_size == world
        assert near(s1.parameters.device, 2 * local)  # stage 1: every rank's compute copy of its TP part
        assert near(s1.master.device, 4 * local / n) and near(s1.optimizer_state.device, 8 * local / n)
        assert near(s3.gradients.device, 4 * local / n)
        # stage 3 (units whole in forward/backward): as for a model of Ψ_local on n ranks whose block is this
        # rank's part of a block guessed from the whole count
        unit = math.ceil(guess_unit_numel(psi) * (1 - (fraction if fraction is not None else 1.0) * (1 - 1 / k)))
        same = estimate_memory(local, world_size=n, stage=3, precision="bf16-mixed", largest_unit_numel=unit)
        assert s3.categories == same.categories
        # the set-up arithmetic sees the same part and the same data-parallel ranks
        assert model_facts(psi, world, **options) == ModelFacts(round(local), math.ceil(local / n), unit, unit)
        assert any(f"tensor parallel {k}" in note for note in s1.notes)
    plain = estimate_memory(psi, world_size=world, stage=2)
    assert plain.tensor_parallel == 1 and not any("tensor parallel" in note for note in plain.notes)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("options", "words"), [
    ({"world_size": 8, "tensor_parallel": 3}, "tensor_parallel=3 does not divide world_size=8"),
    ({"world_size": 8, "tensor_parallel": 0}, "tensor_parallel=0: the tensor-parallel size must be at least 1"),
    ({"world_size": 8, "tensor_parallel": 2, "tp_fraction": 1.5}, "tp_fraction=1.5: the share"),
])  # fmt: skip
def test_tensor_parallel_refuses_bad_sizes_with_what_to_do(options, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        estimate_memory(7e9, stage=3, **options)


@pytest.mark.timeout(60)
def test_cli_tensor_parallel_prints_the_mesh_and_refuses_a_size_not_dividing_the_world():
    done = _cli("--params", "7e9", "--world-size", "8", "--tensor-parallel", "2", "--precision", "bf16-mixed")
    assert done.returncode == 0, done.stderr
    assert "3.5B parameters per tensor-parallel rank, 8 ranks (tensor parallel 2 x ZeRO over 4)" in done.stdout
    zero3 = next(line.split() for line in done.stdout.splitlines() if line.startswith("zero3 "))
    assert float(zero3[4]) == pytest.approx(8 * 3.5e9 / 4 / 2**30, abs=0.01)  # AdamW state: 8 B x Ψ_local / 4
    refused = _cli("--params", "7e9", "--world-size", "8", "--tensor-parallel", "3")
    assert refused.returncode != 0
    assert "zero-estimate: tensor_parallel=3 does not divide world_size=8" in refused.stderr


@pytest.mark.timeout(60)
def test_largest_under_tensor_parallel_names_whole_family_members_and_per_rank_counts(capsys):
    from zero_strategy.estimate.cli import main

    main(["--largest", "--family", "gpt", "--world-size", "4", "--tensor-parallel", "2", "--ram", "64GiB"])
    family = capsys.readouterr().out
    zero1 = next(line for line in family.splitlines() if line.startswith("zero1 "))
    layers = int(re.search(r"\((\d+) layers, width (\d+)\)", zero1).group(1))
    whole = float(zero1.split()[1]) * 1e9
    member = GPTFamily().member(layers)
    assert whole == pytest.approx(member.num_params, rel=1e-3) and "per TP rank" not in zero1
    # the next member does not fit: its per-rank peak under TP 2 (4 ranks sharing the RAM) exceeds 85 % of it
    machine = Machine(ram=64 * 2**30, ranks_per_node=4)
    bigger = compare_peaks(GPTFamily().member(layers + 1), world_size=4, tensor_parallel=2, compute_device="cpu")[0]
    assert not machine.fits(bigger)
    main(["--largest", "--world-size", "4", "--tensor-parallel", "2", "--ram", "64GiB"])
    assert "B params per TP rank" in capsys.readouterr().out
