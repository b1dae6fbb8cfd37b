"""``zero_strategy.grad_norm`` against Lightning's ``grad_norm`` under DDP, and the warning when ``p.grad`` is read
where ZeRO keeps the gradient elsewhere.

The DDP run and the ZeRO runs share one launch of 2 processes: accumulation over 2 micro-batches (DDP's first under
``no_sync``), a parameter only rank 0 uses (DDP(find_unused_parameters=True) averages zeros from rank 1), one no
rank uses and a frozen one (both left out), norm types 2, 1 and inf, at the point where DDP's gradients are
synchronized (after the window's last backward, where Lightning's ``on_before_optimizer_step`` reads them), at
zero1/2/3 and stage 3 on both transports. Mid-window ZeRO's norms are those of the average accumulated so far."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import zero_strategy
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.once import forget_all
from zero_strategy.gradients import ShardedGradientWarning
from zero_strategy.testing import run_in_process, run_ranks

NORMS = (2, 1, "inf")
STEPS = 2


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 7)
        self.blocks = nn.ModuleList(nn.Linear(7, 7) for _ in range(2))
        self.frozen = nn.Linear(7, 7).requires_grad_(False)
        self.branch = nn.Linear(7, 7)  # only rank 0 uses it
        self.unused = nn.Linear(7, 7)  # no rank does
        self.out = nn.Linear(7, 2)

    def forward(self, x: Tensor, use_branch: bool) -> Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        h = self.frozen(h)
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def _model() -> tuple[Probe, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Probe()
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _micro_batches(rank: int, step: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(2)]


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor], rank: int, second: bool = True) -> Tensor:
    """Rank 0 uses the branch in the window's second micro-batch only: a parameter no rank had used when the
    norms were read mid-window must still be stepped on every rank."""
    x, y = batch
    return nn.functional.mse_loss(model(x, use_branch=rank == 0 and second), y) / 2  # accumulation over 2


def _all_norms(module: nn.Module, norm: object) -> dict[str, Tensor]:
    return {k: v.clone() for n in NORMS for k, v in (norm(module, n)).items()}  # type: ignore[operator]


def _ddp_run(rank: int) -> dict:
    model, optimizer = _model()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    seen: dict = {"mid": [], "end": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        first, second = _micro_batches(rank, step)
        with ddp.no_sync():
            _loss(ddp, first, rank, second=False).backward()
        seen["mid"].append(_all_norms(_averaged(model), lightning_grad_norm))
        _loss(ddp, second, rank).backward()
        seen["end"].append(_all_norms(model, lightning_grad_norm))
        optimizer.step()
    seen["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return seen


def _averaged(model: Probe) -> Probe:
    """A copy of ``model`` holding the gradients averaged over the ranks so far (zeros from a rank without one):
    what ZeRO reports mid-window, where DDP's own are each rank's."""
    averaged = copy.deepcopy(model)
    for param, copied in zip(model.parameters(), averaged.parameters(), strict=True):
        if not param.requires_grad:
            continue
        grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        produced = torch.tensor([float(param.grad is not None)])
        dist.all_reduce(grad)
        dist.all_reduce(produced)
        copied.grad = grad / dist.get_world_size() if produced.item() > 0 else None
    return averaged


def _zero_run(rank: int, stage: int, collectives: str) -> dict:
    model, optimizer = _model()
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives=collectives))
    seen: dict = {"mid": [], "end": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        first, second = _micro_batches(rank, step)
        _loss(model, first, rank, second=False).backward()
        seen["mid"].append(_all_norms(model, zero_strategy.grad_norm))  # stage 1 reduces early, the step is the same
        _loss(model, second, rank).backward()
        with engine.step_window(optimizer):  # where Lightning calls on_before_optimizer_step
            seen["end"].append(_all_norms(model, zero_strategy.grad_norm))
            engine.step(optimizer)
    with engine.gathered_parameters():
        seen["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.release()
    return seen


def _runs(rank: int, world_size: int) -> dict:
    runs = {"ddp": _ddp_run(rank)}
    for stage, collectives in ((1, "auto"), (2, "auto"), (3, "auto"), (3, "point_to_point")):
        runs[(stage, collectives)] = _zero_run(rank, stage, collectives)
    return runs


def _assert_norms_equal(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
    for key, value in want.items():
        assert got[key].shape == value.shape == ()
        assert abs(got[key].item() - value.item()) <= 1e-5 * max(1.0, abs(value.item())), f"{what}: {key}"


@pytest.mark.timeout(120)
def test_grad_norm_equals_lightnings_under_ddp() -> None:
    results = run_ranks(_runs, 2, timeout_s=100)
    ddp = results[0]["ddp"]
    keys = list(ddp["end"][0])
    assert "grad_2.0_norm/branch.weight" in keys and "grad_inf_norm_total" in keys
    assert "grad_2.0_norm/branch.weight" not in ddp["mid"][0]
    assert not any("unused" in key or "frozen" in key for key in keys)
    for rank, runs in enumerate(results):
        assert list(runs["ddp"]["end"][0]) == keys  # DDP gives rank 1 the branch's averaged gradient too
        for config, seen in runs.items():
            if config == "ddp":
                continue
            for step in range(STEPS):
                where = f"rank {rank}, {config}, step {step}"
                _assert_norms_equal(seen["end"][step], runs["ddp"]["end"][step], f"{where}, before the step")
                _assert_norms_equal(seen["mid"][step], runs["ddp"]["mid"][step], f"{where}, mid-window")
            for key, value in runs["ddp"]["state"].items():  # reading the norms changed nothing of the steps
                torch.testing.assert_close(seen["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"{config} {key}")


def test_without_an_engine_it_is_lightnings() -> None:
    model, _ = _model()
    _loss(model, _micro_batches(0, 0)[0], 0).backward()
    _assert_norms_equal(_all_norms(model, zero_strategy.grad_norm), _all_norms(model, lightning_grad_norm), "local")
    assert zero_strategy.grad_norm(Probe().unused, 2) == {}
    with pytest.raises(ValueError, match="positive number or 'inf'"):
        zero_strategy.grad_norm(model, 0)


# ------------------------------------------------------------------------------------------ reads of p.grad
@pytest.fixture(autouse=True)
def _fresh_read_sites() -> None:
    """Each place in the code is warned about once per process; each test starts from none."""
    forget_all()


def _reads(rank: int, world_size: int, stage: int) -> list[str]:
    """What reading p.grad says where ZeRO keeps the gradient elsewhere (the messages, in order)."""
    model, optimizer = _model()
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(model, _micro_batches(rank, 0)[0], rank).backward()
        with engine.watching_grad_reads():  # what the precision plugin does around Lightning's gradient hooks
            first = model.inp.weight.grad
            for _ in range(2):
                _ = model.out.bias.grad  # the same line twice: said once
            copied = copy.deepcopy(model.blocks[0]) if stage < 3 else None  # stage 3's sharded class: access.py
        assert copied is None or type(copied.weight) is nn.Parameter  # a copy made in a hook has the plain class
        with engine.step_window(optimizer):
            with engine.watching_grad_reads():
                model.zero_grad()  # Lightning calls it at every stage's start: reads p.grad only to clear it
                after_reduction = model.inp.weight.grad
            engine.step(optimizer)
        optimizer.zero_grad()
        with engine.watching_grad_reads():
            assert model.inp.weight.grad is None  # nothing since zero_grad(): None, as under DDP, and nothing said
        said = [str(w.message) for w in caught if issubclass(w.category, ShardedGradientWarning)]
        assert len(said) == len([w for w in caught])  # nothing else was said
    assert (first is not None) == (stage == 1)  # stage 1 keeps this rank's own gradient until the step
    assert after_reduction is None
    engine.release()
    return said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reading_p_grad_where_the_gradient_is_elsewhere_says_so(stage: int) -> None:
    said = run_in_process(_reads, 1, stage)[0]
    if stage == 1:
        assert len(said) == 3
        assert said[0].startswith("ZeRO stage 1: inp.weight.grad holds this rank's own gradient")
        assert said[1].startswith("ZeRO stage 1: out.bias.grad holds this rank's own gradient")
        assert said[2].startswith("ZeRO: inp.weight.grad is None here, but its gradient exists")
    else:
        assert [s.split(".grad")[0] for s in said] == ["ZeRO: inp.weight", "ZeRO: out.bias", "ZeRO: inp.weight"]
    assert all("zero_strategy.grad_norm(module, norm_type)" in s for s in said)


def _stage_3_outside_the_hooks(rank: int, world_size: int) -> int:
    """At stage 3 the sharded parameters check every read outside forward; ZeRO's own reads never warn."""
    model, optimizer = _model()
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardedGradientWarning)
        for step in range(2):  # ZeRO's own reads of p.grad, all through a training step, never warn
            optimizer.zero_grad()
            for batch in _micro_batches(rank, step):
                _loss(model, batch, rank).backward()
            engine.optimizer_step(optimizer)
            model.zero_grad()
    with pytest.warns(ShardedGradientWarning, match=r"ZeRO: blocks\.0\.weight\.grad is None here"):
        assert model.blocks[0].weight.grad is None
    engine.release()
    return 0


@pytest.mark.timeout(60)
def test_stage_3_reads_are_checked_outside_forward_and_zeros_own_reads_are_not() -> None:
    run_in_process(_stage_3_outside_the_hooks, 1)  # one thread: the warnings filters are the process's
