"""Stage 3's parameters outside forward, on both transports (one host's shared memory, read in place; and
point-to-point, where their memory is freed between uses): never garbage, never a crash (see [Note: parameters
outside forward] in core/flat/access.py). state_dict() and copy.deepcopy gather and give the full values; any
other read raises an error naming the parameter and gathered_parameters(), inside which it reads the full values.
Forwards outside the step and a second forward after a backward gather what they use (see [Note: every forward
gathers] in core/runtime/hooks.py). References: the same model trained under torch's DDP on the same ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import clone_state, lm_loss, make_batches, make_model, rank_slice
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.core.flat.access import ShardedParameterError
from zero_strategy.core.step.engine import ZeroEngine
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
    try:
        model.blocks[1].fc.weight.clone()
        out["read"] = "no error"
    except ShardedParameterError as error:
        out["read"] = str(error)
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
    out["after_eval_read"] = "no error"
    try:
        model.head.weight.sum()
    except ShardedParameterError:
        out["after_eval_read"] = "sharded again"
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
        assert "blocks.1.fc.weight" in r["read"] and "gathered_parameters()" in r["read"], r["read"]
        torch.testing.assert_close(r["gathered_read"], ref["blocks.1.fc.weight"], rtol=1e-5, atol=1e-6)
        assert r["metadata"] == (tuple(ref["blocks.1.fc.weight"].shape), ref["blocks.1.fc.weight"].numel(), True)
        torch.testing.assert_close(r["eval_logits"], r["reference_logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["head_only"], r["reference_head"], rtol=1e-5, atol=1e-5)
        assert r["after_eval_read"] == "sharded again", "a no-grad forward outside a step releases what it gathered"
