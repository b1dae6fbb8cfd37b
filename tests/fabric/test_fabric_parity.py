"""Fabric under ZeRO stages 1-3 trains the same weights as Fabric's own DDP on 1, 2 and 4 CPU ranks: accumulation
through ``no_backward_sync``, clipping by global norm and by value, the split set-up (``setup_module``, an
optimizer from the wrapped module's parameters, ``setup_optimizers``), two optimizers over disjoint parameters, and
a frozen teacher set up without an optimizer. One launch per world size runs DDP and every stage in turn."""

from __future__ import annotations

import pytest
import torch
from helpers.fabric_runs import Net, batch, train, weights
from helpers.launched import as_launched_rank
from helpers.litgpt_runs import make_fabric
from helpers.models import assert_state_close
from lightning.fabric.strategies import DDPStrategy
from torch import nn

from zero_strategy import ZeroFabricStrategy
from zero_strategy.testing import run_ranks

STEPS = 3


def _norm_clip(norms: list[float]):
    def clip(fabric, model, optimizer):
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.05)))
    return clip


def _value_clip(fabric, model, optimizer) -> None:
    fabric.clip_gradients(model, optimizer, clip_val=0.002)


def _adamw_norm(name: str, world: int, split: bool) -> dict:
    """AdamW, clipping by global norm (the norms returned too), accumulation 2; joint or split set-up."""
    fabric = make_fabric(name, world)
    fabric.seed_everything(0)
    model = Net()
    if split:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.02))
    else:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.02))
    norms: list[float] = []
    train(fabric, model, [optimizer], STEPS, clip=_norm_clip(norms))
    out = {"weights": weights(model), "norms": norms}
    if name != "ddp" and world > 1:  # one reduction per step: no_backward_sync skipped the first micro-step's
        engine = fabric.strategy.engine(model)
        trainable = sum(flat.reduce_bytes for flat in engine.flat_params if flat.trainable)
        out["reduced"] = (engine.comm_log.snapshot().get("reduce_scatter", 0), STEPS * trainable)
    return out


def _sgd_value(name: str, world: int) -> dict:
    fabric = make_fabric(name, world)
    fabric.seed_everything(0)
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    train(fabric, model, [optimizer], STEPS, clip=_value_clip)
    return weights(model)


def _two_optimizers(name: str, world: int, split: bool) -> dict:
    """The body stepped by SGD, the head by AdamW; set up together, or after the module."""
    fabric = make_fabric(name, world)
    fabric.seed_everything(0)
    model = Net()
    if split:
        model = fabric.setup_module(model)
    body = torch.optim.SGD([p for n, p in model.named_parameters() if "head." not in n], lr=0.3)
    head = torch.optim.AdamW(model.head.parameters(), lr=0.01)
    if split:
        body, head = fabric.setup_optimizers(body, head)
    else:
        model, body, head = fabric.setup(model, body, head)
    train(fabric, model, [body, head], STEPS)
    return weights(model)


def _distilled(name: str, world: int) -> dict:
    """A student trained to match a frozen teacher; under ZeRO the teacher is set up without an optimizer."""
    fabric = make_fabric(name, world)
    fabric.seed_everything(0)
    teacher, student = Net(width=24), Net()
    teacher.requires_grad_(False)
    teacher.eval()
    if name != "ddp":  # DDP refuses a module with nothing to train: Fabric's DDP users leave the teacher alone
        teacher = fabric.setup_module(teacher)
    student, optimizer = fabric.setup(student, torch.optim.AdamW(student.parameters(), lr=0.02))

    def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(tokens).softmax(-1)
        return nn.functional.cross_entropy(model(tokens).reshape(-1, 11), target.reshape(-1, 11))

    train(fabric, student, [optimizer], STEPS, loss_of=loss_of)
    return {"student": weights(student), "teacher": weights(teacher)}


class _WithSide(Net):
    """Net with a side head that only the first step uses (it shares the root unit with the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(16, 11)

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        logits = super().forward(x)
        return logits + self.side(self.emb(x)) if side else logits


def _cleared_through_the_wrapper(name: str, world: int) -> dict:
    """After ``optimizer.zero_grad()`` on Fabric's wrapper, DDP's side head has no gradient and SGD leaves it
    alone; the engine must see that clear too, or it steps the side head again (momentum) from a stale record of
    use (see [Note: zero_grad through Fabric's wrapper] in zero_strategy/fabric/optimizer_class.py)."""
    fabric = make_fabric(DDPStrategy(find_unused_parameters=True) if name == "ddp" else name, world)
    fabric.seed_everything(0)
    module = _WithSide()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.3, momentum=0.9))
    for step in range(3):
        tokens = batch(step, 0, fabric)
        logits = model(tokens[:, :-1], side=step == 0)
        fabric.backward(nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    out = weights(model)
    out["class"] = (type(optimizer.optimizer).__name__, isinstance(optimizer.optimizer, torch.optim.SGD))
    return out


def each_strategy(rank: int, world: int) -> dict:
    as_launched_rank(rank, world)
    out: dict = {}
    for name in ("ddp", "zero1", "zero2", "zero3"):
        out[(name, "norm")] = _adamw_norm(name, world, split=False)
        out[(name, "value")] = _sgd_value(name, world)
        out[(name, "two")] = _two_optimizers(name, world, split=False)
        out[(name, "teacher")] = _distilled(name, world)
        out[(name, "cleared")] = _cleared_through_the_wrapper(name, world)
        if name != "ddp":
            out[(name, "split")] = _adamw_norm(name, world, split=True)
            out[(name, "two_split")] = _two_optimizers(name, world, split=True)
    fabric = make_fabric("zero3", world)  # Fabric's collectives go through the strategy as under DDP
    mine = torch.tensor([float(rank + 1)])
    out["collectives"] = (fabric.all_reduce(mine.clone(), reduce_op="sum"), fabric.all_gather(mine),
                          fabric.broadcast(f"from {rank}", src=world - 1))
    fabric.barrier()
    # split set-up of a model whose params an explicit ZeroFabricStrategy keeps (one unit: the layout-keeping path)
    out["split_one_unit"] = _adamw_norm(ZeroFabricStrategy(stage=3, unit_modules=["Net"]), world, split=True)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_stage_matches_fabric_ddp(world: int) -> None:
    results = run_ranks(each_strategy, world, timeout_s=200)
    got = results[0]
    ddp = {kind: got[("ddp", kind)] for kind in ("norm", "value", "two", "teacher")}
    assert ddp["norm"]["norms"][0] > 0.05, "the clipping threshold must bite for the test to mean anything"
    for stage in ("zero1", "zero2", "zero3"):
        what = f"{stage}, world {world}"
        for kind in ("norm", "split"):
            run = got[(stage, kind)]
            assert_state_close(run["weights"], ddp["norm"]["weights"], what=f"{what}, {kind}")
            assert run["norms"] == pytest.approx(ddp["norm"]["norms"], rel=1e-5), f"{what}, {kind}: global norm"
            if world > 1:  # stages 2/3 held the first micro-step's gradients; stage 1 reduces at the step anyway
                sent, one_per_step = run["reduced"]
                assert sent == one_per_step, f"{what}, {kind}: {sent} bytes reduced, one per step is {one_per_step}"
        assert_state_close(got[(stage, "value")], ddp["value"], what=f"{what}, clip by value")
        assert_state_close(got[(stage, "two")], ddp["two"], what=f"{what}, two optimizers")
        assert_state_close(got[(stage, "two_split")], ddp["two"], what=f"{what}, two optimizers set up after")
        assert_state_close(got[(stage, "teacher")]["student"], ddp["teacher"]["student"], what=f"{what}, student")
        cleared, ddp_cleared = dict(got[(stage, "cleared")]), dict(got[("ddp", "cleared")])
        assert cleared.pop("class") == ("SGD", True) and ddp_cleared.pop("class") == ("SGD", True)
        assert_state_close(cleared, ddp_cleared, what=f"{what}, zero_grad() on Fabric's wrapper")
        assert_state_close(got[(stage, "teacher")]["teacher"], ddp["teacher"]["teacher"], rel=0.0,
                           what=f"{what}: the frozen teacher is unchanged")
    assert_state_close(got["split_one_unit"]["weights"], ddp["norm"]["weights"], what="split set-up, one unit")
    for rank, rank_result in enumerate(results):
        reduced, gathered, received = rank_result["collectives"]
        assert float(reduced) == world * (world + 1) / 2 and received == f"from {world - 1}", (rank, reduced, received)
        assert gathered.reshape(-1).tolist() == [float(r + 1) for r in range(world)], (rank, gathered)
    for rank_result in results[1:]:  # every rank ends with the same full weights
        assert_state_close(rank_result[("zero3", "norm")]["weights"], got[("zero3", "norm")]["weights"], rel=0.0)
