"""In-place changes to module parameters outside the optimizer, made by every rank as under DDP: a load_state_dict
into the running model, ``mul_``, a re-initialisation (``reset_parameters()``: torch.nn.init), ``p[i] = v`` and
``+=``. They give DDP's result at every stage (stage 3 on one host's shared memory and through the network), on 1
and 2 processes, with offload, and in bf16/fp16, where the change is applied to the fp32 masters exactly (stage 3
outside forward, and stages 1/2, whose whole parameters replay it on the masters) and is taken in rounded, with a
warning, only where it is made inside stage 3's gathered_parameters() (see [Note: in-place changes outside the
optimizer] in core/flat/in_place_watch.py). References: DDP in the same test, or a
single process doing the same math on the masters."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.models import clone_state, lm_loss, make_batches, make_model, rank_slice
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import InPlaceChangeWarning
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded
from zero_strategy.config import OffloadDevice, ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.flat.errors import ShardedParameterError
from zero_strategy.core.flat.whole import gather_whole, param_views
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.runtime.activation_checkpointing import apply_activation_checkpointing, make_policy
from zero_strategy.core.runtime.hooks import in_backward
from zero_strategy.testing import run_ranks

CHANGED = ("blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight", "blocks.1.fc.bias")
LAYOUTS = [(1, "auto"), (2, "auto"), (3, "auto"), (3, "point_to_point")]  # stage 3: shared memory, the network


def loaded_state() -> dict[str, torch.Tensor]:
    """What the running model loads: another model's weights."""
    return clone_state(make_model(seed=3, n_blocks=2))


def change(model: nn.Module) -> None:
    """The changes every rank makes, in code written for DDP."""
    with torch.no_grad():
        model.blocks[1].fc.weight.mul_(0.5)
        torch.manual_seed(7)  # the same draws on every rank, as a seeded DDP run makes them
        model.blocks[0].fc.reset_parameters()  # nn.init.kaiming_uniform_ and uniform_
        model.blocks[1].fc.weight[0] = 1.0
        model.blocks[1].fc.bias += 0.25


def masters(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """The fp32 master weights, whole (collective)."""
    out = {}
    for flat in engine.flat_params:
        whole = gather_whole(flat, flat.shard, "test: masters")
        out |= {name: value.clone() for name, value in param_views(flat, whole)}
    return out


def ddp_worker(rank: int, world: int, stage: int, collectives: str, offload: bool) -> dict:
    """Train a step, load, change, train a step: ZeRO and DDP on the same ranks and data (fp32)."""
    reference = make_model(n_blocks=2)
    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model = make_model(n_blocks=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = ZeroConfig(stage=stage, collectives=collectives,
                        offload_optimizer=OffloadDevice.cpu if offload else OffloadDevice.none)
    engine = ZeroEngine(model, [optimizer], config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (tokens,) in enumerate(make_batches(2, 1, 8)):
            if step == 1:
                for module in (reference, model):
                    module.load_state_dict(loaded_state())
                    change(module)
            lm_loss(ddp, rank_slice(tokens, rank, world)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            lm_loss(model, rank_slice(tokens, rank, world)).backward()
            engine.optimizer_step(optimizer)
            optimizer.zero_grad()
    out = {"zero": clone_state(model), "ddp": clone_state(reference), "host_shared": engine.comms.host_shared,
           "warnings": [str(w.message) for w in caught if issubclass(w.category, InPlaceChangeWarning)]}
    engine.release()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize(("stage", "collectives"), LAYOUTS, ids=["zero1", "zero2", "zero3", "zero3_point_to_point"])
def test_changes_every_rank_makes_give_ddps_result(stage: int, collectives: str, offload: bool, world: int) -> None:
    if stage == 3 and offload and collectives == "auto":
        pytest.skip("stage 3 with offload gathers through the network: the point_to_point case covers it")
    for rank, result in enumerate(run_ranks(ddp_worker, world, stage, collectives, offload, timeout_s=300)):
        assert result["host_shared"] == (stage == 3 and collectives == "auto" and world == 2 and not offload)
        assert_state_close(result["zero"], result["ddp"], rel=1e-5, what=f"rank {rank}")
        assert result["warnings"] == [], f"rank {rank}: an exact change needs no warning: {result['warnings']}"


def precision_worker(rank: int, world: int, stage: int, collectives: str, dtype: torch.dtype,
                     inside_gathered: bool = False) -> dict:
    """Load, change (inside gathered_parameters() if asked), then a step with lr=0 (the step moves nothing; stages
    1/2 take the change in at it): the masters then hold what the same math gives on one process."""
    model = make_model(n_blocks=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives=collectives),
                        policy=MixedPrecisionPolicy(param_dtype=dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(loaded_state())
        if inside_gathered:
            with engine.gathered_parameters():
                change(model)
        else:
            change(model)
        (tokens,) = make_batches(1, 1, 8)[0]
        lm_loss(model, rank_slice(tokens, rank, world)).float().backward()
        engine.optimizer_step(optimizer)
    out = {"masters": masters(engine), "host_shared": engine.comms.host_shared,
           "warnings": [str(w.message) for w in caught if issubclass(w.category, InPlaceChangeWarning)]}
    engine.release()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("inside_gathered", [False, True], ids=["outside", "inside_gathered_parameters"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("stage", "collectives"), LAYOUTS, ids=["zero1", "zero2", "zero3", "zero3_point_to_point"])
def test_changes_in_low_precision_reach_the_fp32_masters(stage: int, collectives: str, dtype: torch.dtype,
                                                         inside_gathered: bool) -> None:
    """Stage 3 outside forward applies the change to the fp32 masters; stages 1/2 (whose whole parameters replay
    it) and stage 3 inside gathered_parameters() (likewise) too: the masters hold DDP's unrounded fp32 result
    exactly, with no warning (see core/flat/exact_writes.py)."""
    loaded = loaded_state()
    fp32 = make_model(n_blocks=2)  # the single-process reference: DDP's fp32 parameters
    fp32.load_state_dict(loaded)
    change(fp32)
    expected = clone_state(fp32)
    low = make_model(n_blocks=2)  # what a rounded take-in would give: the test must tell the two apart
    low.load_state_dict(loaded)
    low.to(dtype)
    change(low)
    assert any(not torch.equal(low.state_dict()[k].float(), expected[k]) for k in CHANGED)
    results = run_ranks(precision_worker, 2, stage, collectives, dtype, inside_gathered, timeout_s=300)
    for rank, result in enumerate(results):
        assert result["host_shared"] == (stage == 3 and collectives == "auto")
        got = {k: v for k, v in result["masters"].items() if k in expected}
        assert_state_close(got, {k: expected[k] for k in got}, rel=0.0, what=f"rank {rank}")  # exact
        assert got.keys() == expected.keys() - {"head.weight"}, sorted(got)  # tied to emb.weight
        assert result["warnings"] == [], f"rank {rank}: an exact change needs no warning: {result['warnings']}"


def inside_worker(rank: int, world: int, stage: int, collectives: str, where: str) -> dict:
    """Every rank changes parameters inside gathered_parameters(), or inside forward (a pre-forward hook clamping a
    weight, as weight-constraint code does), while ZeRO and DDP train on the same ranks and data (fp32)."""
    reference = make_model(n_blocks=2)
    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = make_model(n_blocks=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives=collectives))

    def clamp(module: nn.Module, args: object) -> None:
        with torch.no_grad():
            module.fc.weight.clamp_(-0.05, 0.05)

    if where == "forward":
        for module in (reference, model):
            module.blocks[1].register_forward_pre_hook(clamp)
    out: dict = {"host_shared": engine.comms.host_shared}
    try:
        for step, (tokens,) in enumerate(make_batches(3, 1, 8)):
            if step == 1 and where == "gathered_parameters":
                change(reference)
                with engine.gathered_parameters():
                    change(model)
            lm_loss(ddp, rank_slice(tokens, rank, world)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            lm_loss(model, rank_slice(tokens, rank, world)).backward()
            engine.optimizer_step(optimizer)
            optimizer.zero_grad()
        out |= {"zero": clone_state(model), "ddp": clone_state(reference)}
        engine.release()
    except Exception as error:  # what each rank sees
        out["error"] = f"{type(error).__name__}: {error}"
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["gathered_parameters", "forward"])
@pytest.mark.parametrize(("stage", "collectives"), LAYOUTS, ids=["zero1", "zero2", "zero3", "zero3_point_to_point"])
def test_changes_inside_gathered_parameters_or_forward(stage: int, collectives: str, where: str) -> None:
    """Inside gathered_parameters() each rank changes its own copy and the release takes the change in: DDP's
    result on every transport. Inside forward the same holds, except on one host's shared memory, where the
    parameters are read in place and a change every rank makes lands once per rank: refused, naming it."""
    for rank, result in enumerate(run_ranks(inside_worker, 2, stage, collectives, where, timeout_s=300)):
        assert result["host_shared"] == (stage == 3 and collectives == "auto")
        if result["host_shared"] and where == "forward":  # refused by the clamp itself, not by a release after it
            assert "ShardedParameterError" in result.get("error", ""), f"rank {rank}: {result}"
            assert "blocks.1.fc.weight" in result["error"] and "inside forward" in result["error"], result["error"]
            assert "refused before it changed anything" in result["error"], result["error"]
            continue
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert_state_close(result["zero"], result["ddp"], rel=1e-5, what=f"rank {rank}")


# Writes every rank makes inside forward (in a pre-forward hook of blocks[1]): to the parameter, through a view of
# it, out=, torch.nn.init, p.detach(), p.data
FORWARD_WRITES: dict[str, Callable[[nn.Module], object]] = {
    "clamp_": lambda block: block.fc.weight.clamp_(-0.05, 0.05),
    "view": lambda block: block.fc.weight[0].zero_(),
    "out": lambda block: torch.mul(block.fc.bias, 0.5, out=block.fc.bias),
    "init": lambda block: nn.init.zeros_(block.fc.bias),
    "detach": lambda block: block.fc.weight.detach().mul_(0.5),
    "data": lambda block: block.fc.weight.data.mul_(0.5),
}


def _write_hook(case: str) -> Callable[[nn.Module, object], None]:
    """``case``'s write into blocks[1]; "recomputation": a clamp of blocks[1].fc's weight (its hook's module) only
    when its forward is recomputed in backward (under activation checkpointing), after the entry's forward."""
    def write(module: nn.Module, args: object) -> None:
        if case == "recomputation" and not in_backward():
            return
        with torch.no_grad():
            if case == "recomputation":
                module.weight.clamp_(-0.05, 0.05)
            else:
                FORWARD_WRITES[case](module)
    return write


def _activation_hook(index: int) -> Callable[[nn.Module, object, torch.Tensor], torch.Tensor]:
    """In-place changes of activations inside forward (nn.ReLU(inplace=True)'s call, ``x.mul_()``): no parameter."""
    def change(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return nn.functional.relu(output, inplace=True) if index == 0 else output.mul_(0.5)
    return change


def _read_values(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """What the module's parameters read: their views of each FlatParam's gathered (on one host: host-wide) buffer."""
    return {name: value.clone() for flat in engine.flat_params for name, value in param_views(flat, flat.full)}


def forward_writes_worker(rank: int, world: int, collectives: str) -> dict:
    """Stage 3, fp32. Each case: a step, then a forward whose pre-hook writes into blocks.1.fc: on one host's
    shared memory the write must raise as it is made, with the masters and what the module reads unchanged;
    through the network it is taken in at the release, as DDP takes it (a second step compares). Last: in-place
    changes of activations inside forward train as under DDP."""
    out: dict = {}
    # through the network a change through .data is not seen (a version counter of its own): lost, not DDP's
    cases = [*FORWARD_WRITES, "activations", "recomputation"] if collectives == "auto" else [
        "clamp_", "view", "out", "init", "detach", "activations"]
    for case in cases:
        reference, model = make_model(n_blocks=2), make_model(n_blocks=2)
        ddp = DistributedDataParallel(reference)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = ZeroConfig(stage=3, collectives=collectives)
        if case == "recomputation":  # each Linear a unit of its own inside a checkpointed block
            apply_activation_checkpointing(model, make_policy(["Block"]), offload_to_cpu=False)
            config = ZeroConfig(stage=3, collectives=collectives, unit_modules=["Linear"])
        engine = ZeroEngine(model, [optimizer], config)
        result: dict = {"host_shared": engine.comms.host_shared, "mode": engine.hooks.forward_writes is not None}
        for step, (tokens,) in enumerate(make_batches(2, 1, 8)):
            if step == 1:
                for module in (reference, model) if case != "recomputation" else (model,):
                    if case == "activations":
                        module.blocks[0].register_forward_hook(_activation_hook(0))
                        module.blocks[1].register_forward_hook(_activation_hook(1))
                    else:  # a checkpointed block's hooks stay outside the recomputation: its unit's are inside
                        target = module.blocks[1].fc if case == "recomputation" else module.blocks[1]
                        target.register_forward_pre_hook(_write_hook(case))
                if engine.comms.host_shared:  # through the network the buffers hold nothing between uses
                    result |= {"masters": masters(engine), "read": _read_values(engine)}
            lm_loss(ddp, rank_slice(tokens, rank, world)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            try:
                lm_loss(model, rank_slice(tokens, rank, world)).backward()
            except ShardedParameterError as error:
                frames = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(error.__traceback__)]
                result |= {"error": str(error), "frames": frames}
                break
            engine.optimizer_step(optimizer)
            optimizer.zero_grad()
        result["modes_left"] = len(torch.overrides._get_current_function_mode_stack())  # nothing left pushed
        if "error" in result:
            result |= {"masters_after": masters(engine), "read_after": _read_values(engine)}
        else:
            result |= {"zero": clone_state(model), "ddp": clone_state(reference)}
        engine.release()
        out[case] = result
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collectives", ["auto", "point_to_point"])
def test_writes_inside_forward_are_refused_before_they_land_or_taken_in_exactly(collectives: str) -> None:
    """Stage 3 on one host's shared memory: a change made inside forward to a parameter, a view of it, through
    out=, torch.nn.init, p.detach() or p.data, or in a recomputation under activation checkpointing, raises as it
    is made (the error's traceback ends in the write, not in a unit's release), naming the parameter, and nothing
    is modified: the masters and the values the module reads are as before the forward. Through the network the
    same changes (but .data's) reach the masters at the unit's release: DDP's result. In-place changes of
    activations inside forward are no parameter's: DDP's result on both."""
    for rank, results in enumerate(run_ranks(forward_writes_worker, 2, collectives, timeout_s=400)):
        for case, result in results.items():
            what = f"rank {rank}, {case}"
            assert result["host_shared"] == result["mode"] == (collectives == "auto"), what
            assert result["modes_left"] == 0, f"{what}: a torch function mode was left on the stack"
            if collectives == "auto" and case != "activations":
                error = result.get("error", "")
                assert "blocks.1.fc." in error and "inside forward" in error, f"{what}: {result.get('error')}"
                assert "refused before it changed anything" in error, f"{what}: {error}"
                frames = result["frames"]  # raised by the write itself, in the mode: no unit was released
                assert ("test_in_place_changes.py", "write") in frames, f"{what}: not raised by the write: {frames}"
                assert frames[-1][0] == "forward_writes.py", f"{what}: raised elsewhere: {frames}"
                assert_state_close(result["masters_after"], result["masters"], rel=0.0, what=f"{what}: masters")
                assert_state_close(result["read_after"], result["read"], rel=0.0, what=f"{what}: module's values")
                continue
            assert "error" not in result, f"{what}: {result.get('error')}"
            assert_state_close(result["zero"], result["ddp"], rel=1e-5, what=what)


def save_worker(rank: int, world: int, stage: int, root: str, dtype: torch.dtype | None) -> dict:
    """A step, then every rank changes the weights, then a sharded save (no step in between): the saved masters
    hold the change."""
    model = make_model(n_blocks=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ZeroConfig(stage=stage, offload_optimizer=OffloadDevice.cpu if dtype is None else OffloadDevice.none)
    engine = ZeroEngine(model, [optimizer], config, policy=None if dtype is None else MixedPrecisionPolicy(dtype))
    (tokens,) = make_batches(1, 1, 8)[0]
    lm_loss(model, rank_slice(tokens, rank, world)).float().backward()
    engine.optimizer_step(optimizer)
    before = masters(engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model.blocks[1].fc.weight.mul_(0.5)
        save_sharded(engine, f"{root}/ckpt", {"optimizer_states": [{}], "global_step": 1, "epoch": 0},
                     SaveInfo("32-true", {}, {"zero_strategy": "test", "torch": torch.__version__}))
    engine.release()
    return {"before": before, "warnings": [str(w.message) for w in caught if issubclass(w.category,
                                                                                     InPlaceChangeWarning)]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32_offload", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_a_save_after_a_change_writes_it(stage: int, dtype: torch.dtype | None, tmp_path: Path) -> None:
    """Stages 1/2 with masters apart from the parameters: a change made after the last step reaches the saved
    masters exactly (fp32 offload: taken in before the save; bf16: replayed on the fp32 masters), with no
    warning."""
    results = run_ranks(save_worker, 2, stage, str(tmp_path), dtype, timeout_s=250)
    assert all(result["warnings"] == [] for result in results), [result["warnings"] for result in results]
    before = results[0]["before"]
    saved = torch.load(consolidate(tmp_path / "ckpt", tmp_path / "full.pt", progress=False), weights_only=True)
    weight = before["blocks.1.fc.weight"]
    expected = weight * 0.5  # DDP's fp32 parameter
    assert_state_close({"w": saved["blocks.1.fc.weight"]}, {"w": expected}, rel=0.0)
    untouched = {k: v for k, v in before.items() if k != "blocks.1.fc.weight" and k in saved}
    assert_state_close({k: saved[k] for k in untouched}, untouched, rel=0.0)
