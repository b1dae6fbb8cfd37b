"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` and ``init_module(empty_init=True)`` under ZeRO.

A zero3 run on 2 ranks saves (sharded directory, and the consolidated file) after 2 AdamW steps, with an LR
scheduler and plain values in the state, then trains 2 more steps: the reference. Each checkpoint is loaded by a
zero2 run on 2 ranks and a zero1 run on 1 rank, which train the same 2 steps: the weights must equal the
reference's. Also: the consolidated file loads into a plain module; ``filter`` keeps what it selects; ``strict``;
``load_raw`` of a plain state dict and ``model.load_state_dict`` put each rank's ranges in its slices; a model built
under ``init_module(empty_init=True)`` equals the eager build (recorded construction) or the eager build followed
by every ``reset_parameters()`` (``meta_init="reset_parameters"``, FSDP's contract), bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fabric_runs import Net, train, weights
from helpers.launched import as_launched_rank
from helpers.litgpt_runs import make_fabric
from helpers.models import assert_state_close
from torch import nn

from zero_strategy import ZeroFabricStrategy
from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.testing import run_ranks


def _state(fabric, stage: int, full: bool) -> dict:
    fabric.seed_everything(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}


def _strategy(stage: int, full: bool = False, **options) -> ZeroFabricStrategy:
    return ZeroFabricStrategy(stage=stage, state_dict_type="full" if full else "sharded", **options)


def _two_steps(fabric, state: dict, first: int) -> None:
    for step in range(first, first + 2):
        train(fabric, state["model"], [state["optimizer"]], 1, first_step=step)
        state["scheduler"].step()


def save_and_continue(rank: int, world: int, root: str) -> dict:
    """zero3: 2 steps, save (sharded and full), 2 more steps; the consolidated file and a filtered save."""
    as_launched_rank(rank, world)
    out: dict = {}
    for full in (False, True):
        fabric = make_fabric(_strategy(3, full), world)
        state = _state(fabric, 3, full)
        _two_steps(fabric, state, 0)
        state["step"] = 2
        fabric.save(Path(root) / ("full.pt" if full else "sharded"), state)
        out[("saved", full)] = weights(state["model"])
        _two_steps(fabric, state, 2)
        out[("continued", full)] = weights(state["model"])
        out[("lr", full)] = state["optimizer"].param_groups[0]["lr"]
    fabric.save(Path(root) / "head.pt", {"model": state["model"]}, filter={"model": lambda key, value: "head" in key})
    out.update(load_elsewhere(rank, world, root, stage=2))
    out.update(raw_loads(rank, world, root))
    out.update(built_sharded(rank, world))
    return out


def load_elsewhere(rank: int, world: int, root: str, stage: int) -> dict:
    """Resume both checkpoints at ``stage`` on this world and train the same 2 steps; strict checks."""
    as_launched_rank(rank, world)
    out: dict = {}
    for full in (False, True):
        fabric = make_fabric(_strategy(stage), world)
        state = _state(fabric, stage, full)
        path = Path(root) / ("full.pt" if full else "sharded")
        remainder = fabric.load(path, state)
        out[("loaded", full, world)] = (weights(state["model"]), state["step"], remainder)
        _two_steps(fabric, state, 2)
        out[("resumed", full, world)] = weights(state["model"])
        out[("resumed lr", full, world)] = state["optimizer"].param_groups[0]["lr"]
        with pytest.raises(KeyError, match="extra"):
            fabric.load(path, {**state, "extra": 1})
        fabric.load(path, {"model": state["model"], "extra": 1}, strict=False)  # a key the checkpoint lacks: skipped
    # a model with one more parameter: strict refuses it, strict=False loads what matches and keeps the rest
    fabric = make_fabric(_strategy(stage), world)
    fabric.seed_everything(0)
    grown = Net()
    grown.extra = nn.Linear(2, 2)
    initial_extra = grown.extra.weight.detach().clone()
    grown = fabric.setup_module(grown)
    with pytest.raises(CheckpointError, match="missing parameters"):
        fabric.load(Path(root) / "sharded", {"model": grown})
    fabric.load(Path(root) / "sharded", {"model": grown}, strict=False)
    out[("grown", world)] = (weights(grown), initial_extra)
    return out


def raw_loads(rank: int, world: int, root: str) -> dict:
    """``load_raw`` of a plain state dict file, and ``model.load_state_dict`` of a plain state dict, at stage 3."""
    torch.manual_seed(42)
    plain = Net().state_dict()
    if rank == 0:
        torch.save(plain, Path(root) / "raw.pt")
    out: dict = {"plain": plain}
    fabric = make_fabric(_strategy(3), world)
    fabric.barrier()
    model = fabric.setup_module(Net())
    fabric.load_raw(Path(root) / "raw.pt", model)
    out["load_raw"] = weights(model)
    torch.manual_seed(43)
    other = Net().state_dict()
    model.load_state_dict(other)  # litgpt's load_checkpoint for any strategy but FSDP
    out["load_state_dict"] = (weights(model), other)
    return out


class Tower(nn.Module):
    """A module whose reset_parameters() (assigned after construction, as litgpt assigns its initializers) differs
    from its construction's initialization."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.register_buffer("table", torch.arange(8.0) * 0.5)


def _custom_init(layer: nn.Linear) -> None:
    nn.init.normal_(layer.weight, std=0.02)
    nn.init.zeros_(layer.bias)


def _replace_initializers(model: Tower) -> None:
    for layer in model.layers:
        layer.reset_parameters = lambda layer=layer: _custom_init(layer)  # type: ignore[method-assign]


def built_sharded(rank: int, world: int) -> dict:
    """``init_module(empty_init=True)`` at stage 3 with both initialization contracts, and the eager references."""
    out: dict = {}
    torch.manual_seed(5)
    out["eager"] = weights(Tower())
    ddp = make_fabric("ddp", world)
    torch.manual_seed(5)
    with ddp.init_module(empty_init=True):  # what litgpt's pretraining does under DDP: uninitialized memory, then
        tower = Tower()
    _replace_initializers(tower)
    for sub in tower.modules():  # every reset_parameters(), its initializers assigned after construction
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()
    out["eager reset"] = weights(tower)
    for contract in ("replay", "reset_parameters"):
        fabric = make_fabric(_strategy(3, unit_modules=["Linear"], meta_init=contract), world)
        torch.manual_seed(5)
        with fabric.init_module(empty_init=True):
            tower = Tower()
        assert all(p.is_meta for p in tower.parameters())
        _replace_initializers(tower)
        tower = fabric.setup_module(tower)
        out[contract] = weights(tower)
    return out


@pytest.mark.timeout(240)
def test_save_load_across_worlds_and_stages(tmp_path: Path) -> None:
    root = str(tmp_path)
    results = run_ranks(save_and_continue, 2, root, timeout_s=200)
    got = results[0]
    got.update(run_ranks(load_elsewhere, 1, root, 1, timeout_s=200)[0])  # zero1 on one rank
    assert (tmp_path / "sharded" / "manifest.json").is_file() and (tmp_path / "full.pt").is_file()
    for full in (False, True):
        what = "consolidated file" if full else "sharded directory"
        assert_state_close(got[("continued", full)], got[("continued", not full)], rel=0.0, what="both runs")
        for world in (1, 2):
            loaded, step, remainder = got[("loaded", full, world)]
            assert_state_close(loaded, got[("saved", full)], rel=1e-7, what=f"{what} loaded on {world} rank(s)")
            assert step == 2 and "zero_strategy.fabric" not in remainder, (what, step, remainder)
            assert_state_close(got[("resumed", full, world)], got[("continued", full)], rel=1e-6,
                               what=f"{what} resumed on {world} rank(s)")
            assert got[("resumed lr", full, world)] == got[("lr", full)]  # the scheduler resumed too
        grown, initial_extra = got[("grown", 2 if full else 1)]
        assert torch.equal(grown["extra.weight"], initial_extra)
        assert_state_close({k: v for k, v in grown.items() if not k.startswith("extra")}, got[("saved", False)],
                           rel=1e-7, what="strict=False")
    consolidated = torch.load(tmp_path / "full.pt", weights_only=True)
    plain = Net()
    plain.load_state_dict(consolidated["model"])  # a plain module loads the consolidated file
    assert_state_close(weights(plain), got[("saved", True)], rel=0.0, what="the consolidated file")
    head = torch.load(tmp_path / "head.pt", weights_only=True)["model"]
    assert sorted(head) == ["head.bias", "head.weight"], sorted(head)
    assert_state_close(head, {k: got[("continued", True)][k] for k in head}, rel=0.0, what="filtered save")
    assert_state_close(got["load_raw"], got["plain"], rel=0.0, what="load_raw")
    loaded, other = got["load_state_dict"]
    assert_state_close(loaded, other, rel=0.0, what="model.load_state_dict at stage 3")
    assert_state_close(got["replay"], got["eager"], rel=0.0, what="init_module(empty_init=True), replayed")
    assert_state_close(got["reset_parameters"], got["eager reset"], rel=0.0, what="meta_init='reset_parameters'")
    assert not torch.equal(got["eager"]["layers.0.weight"], got["eager reset"]["layers.0.weight"])
