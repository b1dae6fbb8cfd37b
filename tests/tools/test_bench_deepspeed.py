"""The benchmark's DeepSpeed rows.

Where DeepSpeed is installed, end to end on the tiny preset: DeepSpeed trains the same model to the same losses as
DDP, the counter sees its collectives, and the model-state walk finds its partitions and buffers. DeepSpeed holds
more than the ZeRO paper's 16Ψ family (see [Note: how DeepSpeed is configured] in ``benchmarks.bench_deepspeed``),
so the state is held to DeepSpeed's own layout; its ratio to the shared theory is what the table prints.
DeepSpeed is no dependency of this package and CI does not install it: there that test skips, saying so.

What the rows rely on that is not DeepSpeed's runs everywhere: the counter's wrappers of the extra collective
entry points (each call counted once, in the right kind, and removed afterwards), the config the rows pass (read
by this package's own DeepSpeed importer), the micro-batch a row is given, and the error when the rows are asked
for without DeepSpeed.

The first DeepSpeed run on a machine builds its CPU shared-memory op (about a minute, cached afterwards).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from helpers.bench_report import table_rows

from benchmarks.bench_counter import CollectiveCounter
from benchmarks.bench_deepspeed import count_deepspeed_collectives, deepspeed_config, preset_micro_batch
from benchmarks.bench_methods import BUILDERS
from benchmarks.bench_model import PRESETS, build_model
from benchmarks.benchmark import BenchOptions, main
from zero_strategy.deepspeed_config import UnmappedDeepSpeedKeysWarning, parse_deepspeed_config
from zero_strategy.testing import run_ranks

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = (
    "DeepSpeed is not installed (no dependency of zero_strategy; CI does not install it): the DeepSpeed rows "
    "are checked only where it is, e.g. the README's Benchmark virtualenv"
)

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


@pytest.mark.skipif(not HAS_DEEPSPEED, reason=NO_DEEPSPEED)
@pytest.mark.timeout(180)  # under 60 s once DeepSpeed's op is built; see the module docstring
def test_deepspeed_rows_match_ddp_and_deepspeeds_layout() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator
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


def _count_each_entry_point(rank: int, world: int) -> dict[str, Any]:
    """On each rank: install the benchmark's wrappers as its DeepSpeed row does (the counter's own table on
    ``torch.distributed``, then the DeepSpeed extras), call each extra entry point once on a 4-element fp32 tensor
    (16 bytes), and return what was counted after each call, and whether removing the wrappers restored them."""
    originals = {name: getattr(dist, name) for name in ("reduce", "all_gather", "_all_gather_base")}
    originals_c10d = {name: getattr(c10d, name) for name in ("all_gather_into_tensor", "reduce_scatter")}
    counter = CollectiveCounter()
    counter.install()
    count_deepspeed_collectives(counter)
    x = torch.ones(4)
    calls = {
        "reduce": lambda: dist.reduce(x.clone(), dst=0),
        "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(world)], x),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.empty(4), [x.clone() for _ in range(world)]),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([x.clone()]),
        "_all_gather_base": lambda: dist._all_gather_base(torch.empty(4 * world), x),
        "_reduce_scatter_base": lambda: dist._reduce_scatter_base(torch.empty(4), x.repeat(world)),
        "c10d.all_gather_into_tensor": lambda: c10d.all_gather_into_tensor(torch.empty(4 * world), x),
        "c10d.reduce_scatter": lambda: c10d.reduce_scatter(torch.empty(4), [x.clone() for _ in range(world)]),
    }
    after: dict[str, dict[str, int]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warnings for the old names DeepSpeed may call
        for name, call in calls.items():
            before = dict(counter.bytes_by_kind)
            call()
            now = dict(counter.bytes_by_kind)
            after[name] = {kind: now[kind] - before.get(kind, 0) for kind in now if now[kind] != before.get(kind, 0)}
    counter.remove()
    restored = all(getattr(dist, n) is f for n, f in originals.items())
    restored &= all(getattr(c10d, n) is f for n, f in originals_c10d.items())
    return {"after": after, "restored": restored}


@pytest.mark.timeout(120)  # two forked gloo ranks, a few collectives: about a second
def test_the_counter_counts_each_extra_collective_entry_point_once() -> None:
    """The DeepSpeed rows' traffic rests on these wrappers: each entry point counted once (one wrapped function
    calling another, as ``_all_gather_base`` does, is not counted twice), in its kind, by the convention (an
    all-reduce twice its buffer, the others their full buffer once); and removed afterwards."""
    world, nbytes = 2, 16
    expected = {
        "reduce": {"reduce": nbytes},
        "all_gather": {"all_gather": world * nbytes},
        "reduce_scatter": {"reduce_scatter": world * nbytes},
        "all_reduce_coalesced": {"all_reduce": 2 * nbytes},
        "_all_gather_base": {"all_gather": world * nbytes},
        "_reduce_scatter_base": {"reduce_scatter": world * nbytes},
        "c10d.all_gather_into_tensor": {"all_gather": world * nbytes},
        "c10d.reduce_scatter": {"reduce_scatter": world * nbytes},
    }
    for rank, result in enumerate(run_ranks(_count_each_entry_point, world, timeout_s=60)):
        assert result["after"] == expected, f"rank {rank}"
        assert result["restored"], f"rank {rank}: the counter left a wrapper in torch.distributed"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_rows_config_reads_as_fp32_zero_stage_without_clipping(stage: int) -> None:
    """The config each DeepSpeed row passes, read by this package's DeepSpeed importer: the stage, fp32, no
    clipping, one micro-batch of the given size per step, and the reduce bucket (Ψ)."""
    config = deepspeed_config(stage, micro_batch=4, psi=1234)
    assert config["zero_optimization"]["reduce_bucket_size"] == 1234
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        imported = parse_deepspeed_config(config)
    options = {"stage": stage, "allow_untested_optimizer": True}
    if stage == 3:  # our stage 3 gathers whole units: the bucket has no counterpart, and the importer says so
        assert imported.unmapped == ["zero_optimization.reduce_bucket_size"]
        assert [type(w.message) for w in caught] == [UnmappedDeepSpeedKeysWarning]
    else:  # stages 1/2: the reduce bucket is our communication unit's size
        options["min_unit_numel"] = 1234
        assert imported.unmapped == [] and caught == []
    assert imported.zero_options == options
    assert (imported.precision, imported.gradient_clip_val) == ("32-true", None)
    assert (imported.batch.micro_batch_size, imported.batch.gradient_accumulation_steps) == (4, 1)


def test_each_preset_gives_its_own_micro_batch() -> None:
    """A DeepSpeed row is built from the model alone; the micro-batch its config declares is found by the model's
    shape (on the meta device here: only shapes are read)."""
    for name, shape in PRESETS.items():
        with torch.device("meta"):
            model = build_model(shape)
        assert preset_micro_batch(model) == shape.batch, name
    with torch.device("meta"):
        model = build_model(dataclasses.replace(PRESETS["tiny"], n_layer=3, batch=7))
    assert preset_micro_batch(model) == 1, "a model of no preset"


@pytest.mark.skipif(HAS_DEEPSPEED, reason="DeepSpeed is installed here: its rows exist")
def test_without_deepspeed_its_rows_are_absent_and_asking_for_one_says_why() -> None:
    assert not [method for method in BUILDERS if "deepspeed" in method]
    with pytest.raises(ValueError, match=r"deepspeed_zero3: the DeepSpeed rows need DeepSpeed, which is not installed"):
        BenchOptions(params="tiny", methods=["ddp", "deepspeed_zero3"])
