"""Stage 3's parameters outside forward, on both transports (one host's shared memory, read in place; and
point-to-point, where their memory is freed between uses): never garbage, never a crash (see [Note: parameters
outside forward] in core/flat/access.py). state_dict(), copy.deepcopy and every read of the values give DDP's values;
only where the values are (data_ptr, storage_offset) and ``.data`` raise an error naming the parameter.
Forwards outside the step and a second forward after a backward gather what they use (see [Note: every forward
gathers] in core/runtime/hooks.py). References: the same model trained under torch's DDP on the same ranks."""

from __future__ import annotations

import copy
import math
import operator
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.models import clone_state, lm_loss, make_batches, make_model, rank_slice
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.flat.access import ShardedParameterError
from zero_strategy.core.flat.errors import is_sharded
from zero_strategy.testing import run_ranks

TRANSPORTS = ["auto", "point_to_point"]


def _closure_steps(model: torch.nn.Module, step: callable, rank: int, world: int) -> None:
    """Two forwards and two backwards per step (a closure / GAN pattern): the second forward comes after the
    first backward released everything."""
    for micro in make_batches(2, 2, 8):
        first, second = (rank_slice(tokens, rank, world) for tokens in micro)
        lm_loss(model, first).backward(retain_graph=False)
        lm_loss(model, second).backward()
        step()


def outside_worker(rank: int, world: int, collectives: str) -> dict:
    reference = make_model()
    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def ddp_step() -> None:
        ref_opt.step()
        ref_opt.zero_grad()

    _closure_steps(ddp, ddp_step, rank, world)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, collectives=collectives))

    def zero_step() -> None:
        engine.optimizer_step(optimizer)
        optimizer.zero_grad()

    _closure_steps(model, zero_step, rank, world)
    out: dict = {"reference": clone_state(reference), "host_shared": engine.comms.host_shared}
    out["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}  # gathers, every rank
    out["submodule_state_dict"] = {k: v.clone() for k, v in model.blocks[0].state_dict().items()}
    out["deepcopy"] = clone_state(copy.deepcopy(model))  # gathers, every rank
    # a submodule holding root-unit parameters (the embedding) carries the engine's hooks: its copy is plain
    emb_copy = copy.deepcopy(model.emb)
    out["submodule_deepcopy"] = clone_state(emb_copy)
    out["copy_hooks_inert"] = emb_copy(torch.zeros(1, 2, dtype=torch.long)).shape
    out["read"] = model.blocks[1].fc.weight.clone()  # every rank reads: DDP's values
    out["read_grad"] = out["read"].requires_grad  # as DDP's clone
    out["read"] = out["read"].detach()
    try:
        model.blocks[1].fc.weight.data  # noqa: B018 (the read under test)
        out["data"] = "no error"
    except ShardedParameterError as error:
        out["data"] = str(error)
    with engine.gathered_parameters():
        out["gathered_read"] = model.blocks[1].fc.weight.clone()
    out["metadata"] = (tuple(model.blocks[1].fc.weight.shape), model.blocks[1].fc.weight.numel(),
                       model.blocks[1].fc.weight.requires_grad)
    with torch.no_grad():  # a forward outside any step (an evaluation callback), of a submodule using root params
        tokens = make_batches(1, 1, 2)[0][0]
        out["eval_logits"] = model(tokens).clone()
        out["reference_logits"] = reference(tokens).clone()
        out["head_only"] = model.head(torch.ones(1, model.emb.weight.shape[1])).clone()
        out["reference_head"] = reference.head(torch.ones(1, reference.emb.weight.shape[1])).clone()
    out["after_eval_read"] = "sharded again" if is_sharded(model.head.weight) else "still gathered"
    engine.release()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collectives", TRANSPORTS)
def test_parameters_outside_forward_are_gathered_or_refused_never_garbage(collectives: str) -> None:
    for r in run_ranks(outside_worker, 2, collectives, timeout_s=100):
        assert r["host_shared"] == (collectives == "auto"), "the test must cover both transports"
        ref = r["reference"]
        for what in ("state_dict", "deepcopy"):
            assert r[what].keys() == ref.keys()
            for key, value in ref.items():  # the closure steps trained like DDP, and the copies hold full values
                torch.testing.assert_close(r[what][key], value, rtol=1e-5, atol=1e-6, msg=f"{what} {key}")
        for key, value in r["submodule_state_dict"].items():
            torch.testing.assert_close(value, ref[f"blocks.0.{key}"], rtol=1e-5, atol=1e-6)
        for key, value in r["submodule_deepcopy"].items():
            torch.testing.assert_close(value, ref[f"emb.{key}"], rtol=1e-5, atol=1e-6)
        assert r["copy_hooks_inert"][:2] == (1, 2)
        torch.testing.assert_close(r["read"], ref["blocks.1.fc.weight"], rtol=1e-5, atol=1e-6)
        assert r["read_grad"], "a clone of a parameter requires a gradient, as under DDP"
        assert "blocks.1.fc.weight" in r["data"] and "gathered_parameters()" in r["data"], r["data"]
        torch.testing.assert_close(r["gathered_read"], ref["blocks.1.fc.weight"], rtol=1e-5, atol=1e-6)
        assert r["metadata"] == (tuple(ref["blocks.1.fc.weight"].shape), ref["blocks.1.fc.weight"].numel(), True)
        torch.testing.assert_close(r["eval_logits"], r["reference_logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["head_only"], r["reference_head"], rtol=1e-5, atol=1e-5)
        assert r["after_eval_read"] == "sharded again", "a no-grad forward outside a step releases what it gathered"


class _ScaledBlock(torch.nn.Module):
    """A unit with a one-element parameter (a learned gain): the parameter ``bool()``/``item()`` look natural on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.gain = torch.nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gain


def _scaled_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_ScaledBlock(), _ScaledBlock())


# Every read that looks like metadata, and the value reads next to them. Each must answer as on a plain (DDP)
# parameter (or raise ShardedParameterError where no answer could be DDP's), and alike on both transports.
METADATA_LOOKING_READS: dict[str, Callable[[torch.nn.Parameter], Any]] = {
    "bool": bool, "item": lambda p: p.item(), "float": float, "int": int, "index": operator.index,
    "isnan": math.isnan, "round": round, "len": len, "tolist": lambda p: p.tolist(), "iter": list,
    "format_spec": lambda p: f"{p:.3f}", "numel": lambda p: p.numel(), "shape": lambda p: tuple(p.shape),
    "size": lambda p: p.size(), "dim": lambda p: p.dim(), "dtype": lambda p: p.dtype, "device": lambda p: p.device,
    "requires_grad": lambda p: p.requires_grad, "is_leaf": lambda p: p.is_leaf, "grad": lambda p: p.grad,
    "nbytes": lambda p: p.nbytes, "element_size": lambda p: p.element_size(), "stride": lambda p: p.stride(),
    "is_contiguous": lambda p: p.is_contiguous(), "get_device": lambda p: p.get_device(),
    "data_ptr": lambda p: p.data_ptr(), "storage_offset": lambda p: p.storage_offset(),
    "nonzero": lambda p: p.nonzero(), "eq": lambda p: p == 1.5, "gt": lambda p: p > 0, "ne": lambda p: p != p,
    "equal": lambda p: torch.equal(p, p), "norm": lambda p: p.norm(), "sum": lambda p: p.sum(),
    "abs": abs, "neg": lambda p: -p, "is_nonzero": lambda p: p.is_nonzero(), "data": lambda p: p.data,
    "detach": lambda p: p.detach(), "numpy": lambda p: p.detach().numpy(), "clone": lambda p: p.clone(),
    "in_list": lambda p: p in [p], "same_hash": lambda p: hash(p) == id(p),
}
REFUSED = "ShardedParameterError"
# untyped_storage() is let through and reports the memory as it is, which differs by design (see [Note: parameters
# outside forward]): the host-wide buffer on one host, a freed storage on the network path.
STORAGE_BYTES = "untyped_storage().nbytes()"


def _outcome(read: Callable[[torch.nn.Parameter], Any], param: torch.nn.Parameter) -> tuple[str, Any]:
    try:
        value = read(param)
    except ShardedParameterError:
        return (REFUSED, None)
    except Exception as error:  # what a plain parameter raises too (round, a format spec): compared by type
        return ("raised", type(error).__name__)
    return ("value", _comparable(value))


def _comparable(value: Any) -> Any:
    """A result as a plain value or tensor that ``==`` / torch.equal can compare (iter(p) gives rows, numpy an
    array)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().as_subclass(torch.Tensor)  # plain, whatever subclass the read returned
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return torch.stack([v.detach().clone().as_subclass(torch.Tensor) for v in value])
    if type(value).__module__ == "numpy":
        return torch.from_numpy(value.copy())
    return value


def reads_worker(rank: int, world: int, collectives: str) -> dict:
    plain = _scaled_model()  # the reference: a parameter as DDP leaves it (DDP does not change its parameters)
    model = _scaled_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ZeroConfig(stage=3, collectives=collectives, unit_modules=["_ScaledBlock"], min_unit_numel=1)
    engine = ZeroEngine(model, [optimizer], config)
    out: dict = {"host_shared": engine.comms.host_shared, "zero": {}, "plain": {}}
    for name in ("1.gain", "1.fc.bias", "1.fc.weight"):  # one element, and larger (data_ptr, storage_offset)
        zero_param, plain_param = model.get_parameter(name), plain.get_parameter(name)
        out["zero"][name] = {what: _outcome(read, zero_param) for what, read in METADATA_LOOKING_READS.items()}
        out["plain"][name] = {what: _outcome(read, plain_param) for what, read in METADATA_LOOKING_READS.items()}
        out["zero"][name][STORAGE_BYTES] = zero_param.untyped_storage().nbytes()
    engine.release()
    return out


@pytest.mark.timeout(180)
def test_every_metadata_looking_read_answers_as_ddp_or_refuses_alike_on_both_transports() -> None:
    by_transport = {c: run_ranks(reads_worker, 2, c, timeout_s=150)[0] for c in TRANSPORTS}
    assert [r["host_shared"] for r in by_transport.values()] == [True, False], "both transports must be covered"
    shared, network = by_transport["auto"], by_transport["point_to_point"]
    refused = set()
    for name, plain in shared["plain"].items():
        for what, reference in plain.items():
            answers = {c: r["zero"][name][what] for c, r in by_transport.items()}
            kinds = {c: answer[0] for c, answer in answers.items()}
            assert kinds["auto"] == kinds["point_to_point"], f"{name} {what}: transports disagree: {answers}"
            answer = answers["auto"]
            if answer[0] == REFUSED:
                refused.add(what)
                continue
            assert answer[0] == reference[0], f"{name} {what}: {answer} where a plain parameter gives {reference}"
            for got in (answer[1], network["zero"][name][what][1]):
                if isinstance(reference[1], torch.Tensor):
                    assert torch.equal(got, reference[1]), f"{name} {what}: {got} != {reference[1]}"
                else:
                    assert got == reference[1], f"{name} {what}: {got!r} != {reference[1]!r} (plain)"
    # where the values are and `.data` are refused, by name, on both transports; every other read gives the values
    assert refused == {"data_ptr", "storage_offset", "data"}, refused
    for name in shared["zero"]:  # the memory as it is: mapped on one host, freed on the network path
        assert shared["zero"][name][STORAGE_BYTES] > 0 and network["zero"][name][STORAGE_BYTES] == 0, name


def every_rank_reads_worker(rank: int, world: int, stage: int, collectives: str) -> dict:
    """Code written for DDP, every rank: ``before = w.clone()`` and a norm before the step, the change after it."""
    reference = make_model()
    ddp = DistributedDataParallel(reference)
    model = make_model()
    out: dict = {"ddp": [], "zero": []}
    zero_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = ZeroEngine(model, [zero_opt], ZeroConfig(stage=stage, collectives=collectives))
    out["host_shared"] = engine.comms.host_shared
    for name, module, wrapped, optimizer in (
        ("ddp", reference, ddp, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)),
        ("zero", model, model, zero_opt),
    ):
        for (tokens,) in make_batches(2, 1, 8):
            lm_loss(wrapped, rank_slice(tokens, rank, world)).backward()
            weight = module.blocks[1].fc.weight
            before = weight.clone()  # grad mode on, as in training_step
            norm = float(weight.norm())
            engine.optimizer_step(optimizer) if name == "zero" else optimizer.step()
            optimizer.zero_grad()
            delta = (weight - before).detach()
            out[name].append({"before": before.detach(), "delta": delta, "norm": torch.tensor(norm),
                              "moved": torch.tensor(float(not torch.equal(weight, before))),
                              "tolist": torch.tensor(module.blocks[0].fc.bias.tolist())})
    engine.release()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("stage", "collectives"), [(1, "auto"), (2, "auto"), (3, "auto"), (3, "point_to_point")],
                         ids=["zero1", "zero2", "zero3", "zero3_point_to_point"])
def test_reads_every_rank_makes_give_ddps_values(stage: int, collectives: str, world: int) -> None:
    for rank, result in enumerate(run_ranks(every_rank_reads_worker, world, stage, collectives, timeout_s=250)):
        assert result["host_shared"] == (stage == 3 and collectives == "auto" and world == 2)
        for step, (got, ref) in enumerate(zip(result["zero"], result["ddp"], strict=True)):
            assert_state_close(got, ref, rel=1e-5, what=f"rank {rank} step {step}")
            assert got["moved"].item() == 1.0, "the step moved the weight: the read before it is not a view"


def rank_zero_worker(rank: int, world: int, collectives: str, write: bool) -> dict:
    """Rank 0 alone reads (or changes) a parameter, then every rank trains a step."""
    reference = make_model()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ZeroConfig(stage=3, collectives=collectives, process_group_timeout_s=15)
    engine = ZeroEngine(model, [optimizer], config)
    out: dict = {"host_shared": engine.comms.host_shared}
    started = time.monotonic()
    try:
        if rank == 0 and write:
            with torch.no_grad():
                model.blocks[1].fc.weight.mul_(0.5)
        elif rank == 0:
            out["read"] = model.blocks[1].fc.weight.detach().clone()
            out["reference"] = reference.blocks[1].fc.weight.detach().clone()
        (tokens,) = make_batches(1, 1, 8)[0]
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        engine.optimizer_step(optimizer)
        out["outcome"] = "trained"
    except Exception as error:  # what each rank sees
        out["outcome"] = f"{type(error).__name__}: {error}"
    out["seconds"] = time.monotonic() - started
    if out["outcome"] == "trained":
        engine.release()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collectives", [*TRANSPORTS, "native"])
def test_a_read_only_rank_zero_makes_answers_or_stops_every_rank_naming_the_parameter(collectives: str) -> None:
    """gloo's own collectives ("native") carry no label: such gathers go point-to-point there, and end the same."""
    results = run_ranks(rank_zero_worker, 2, collectives, False, timeout_s=120, pg_timeout_s=60)
    assert [r["host_shared"] for r in results] == [collectives == "auto"] * 2
    if collectives == "auto":  # read in place, no exchange: DDP's value, and training goes on
        torch.testing.assert_close(results[0]["read"], results[0]["reference"], rtol=0, atol=0)
        assert [r["outcome"] for r in results] == ["trained", "trained"]
        return
    for rank, result in enumerate(results):  # through the network: a gather only rank 0 made, caught by the watch
        assert result["outcome"].startswith("DivergedGathersError"), f"rank {rank}: {result['outcome']}"
        assert "blocks.1.fc.weight" in result["outcome"] and "gathered_parameters()" in result["outcome"]
        assert result["seconds"] < 30, f"rank {rank} stopped after {result['seconds']:.0f} s, not within seconds"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collectives", TRANSPORTS)
def test_a_change_only_rank_zero_makes_stops_every_rank_and_changes_nothing(collectives: str) -> None:
    results = run_ranks(rank_zero_worker, 2, collectives, True, timeout_s=200, pg_timeout_s=60)
    outcomes = [r["outcome"] for r in results]
    assert "trained" not in outcomes, outcomes
    # rank 0 names the parameter: through the network within seconds (the watch), on one host's shared memory
    # after process_group_timeout_s (its exchange pairs only with the same change on the peers, which never comes)
    assert "blocks.1.fc.weight" in outcomes[0] and "every rank" in outcomes[0], outcomes[0]
    if collectives == "point_to_point":
        assert all("blocks.1.fc.weight" in outcome for outcome in outcomes), outcomes
        assert all(r["seconds"] < 30 for r in results), [r["seconds"] for r in results]


def refused_changes_worker(rank: int, world: int, collectives: str) -> dict:
    model = make_model()
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3,
                                                                                        collectives=collectives))
    weight = model.blocks[1].fc.weight
    before = weight.detach().clone()
    attempts = {
        "through a view": lambda: weight.detach().mul_(2.0),
        "through an index": lambda: weight[0].zero_(),
        "through view_as (nn.init.orthogonal_)": lambda: torch.nn.init.orthogonal_(weight),
        "autograd on": lambda: weight.mul_(2.0),
        "data": lambda: weight.data.mul_(2.0),
    }
    out: dict = {"host_shared": engine.comms.host_shared}
    for what, attempt in attempts.items():
        try:
            if what == "autograd on":
                attempt()
            else:
                with torch.no_grad():
                    attempt()
            out[what] = "no error"
        except (ShardedParameterError, RuntimeError) as error:
            out[what] = f"{type(error).__name__}: {error}"
    out["unchanged"] = bool(torch.equal(weight.detach(), before))
    engine.release()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collectives", TRANSPORTS)
def test_changes_that_cannot_reach_the_masters_are_refused_before_anything_changes(collectives: str) -> None:
    for rank, result in enumerate(run_ranks(refused_changes_worker, 2, collectives, timeout_s=100)):
        assert result.pop("host_shared") == (collectives == "auto")
        assert result.pop("unchanged"), f"rank {rank}: a refused change modified the weight"
        for what, outcome in result.items():
            if what == "autograd on":  # torch's own error, as under DDP
                assert "leaf Variable that requires grad" in outcome, outcome
            else:
                assert outcome.startswith("ShardedParameterError") and "blocks.1.fc.weight" in outcome, (what, outcome)
