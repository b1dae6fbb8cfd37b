"""The core's lifecycles as explicit states, on ranks simulated by threads (``run_in_process``: no processes, well
under a second): a stage-3 FlatParam's parameters go SHARDED → GATHERING → UNSHARDED → SHARDED, holding every
rank's slice when gathered and no memory when sharded; an optimizer's step window goes ACCUMULATING → STEPPING →
ACCUMULATING, and a call in the wrong phase is an error naming the phase, raised before anything changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_strategy import ShardedParameterError, ZeroConfig, ZeroEngine
from zero_strategy.core.engine.window import StepOrderError
from zero_strategy.testing import run_in_process


def _model() -> nn.Module:
    """Values from a generator of its own: the simulated ranks are threads sharing torch's global one."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    values = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=values))
    return model


def _loss(model: nn.Module, rank: int) -> torch.Tensor:
    return model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).pow(2).mean()


def _parameter_lifecycle(rank: int, world: int) -> list[dict]:
    """Walk each FlatParam that stage 3 frees between uses through its states; note what it holds in each."""
    model = _model()
    name_of = {id(param): name for name, param in model.named_parameters()}
    whole = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3, min_unit_numel=100))
    walked = []
    for flat in engine.flat_params:
        if flat.keeps_full:
            continue
        flat.reshard()
        states = [flat.state.name]
        sharded_bytes = flat.storage.full.resident_bytes
        # a read outside forward (every rank makes it) gathers for the read and lets go again; `.data` is refused
        read_sum = bool(torch.equal(flat.params[0].sum(), whole[name_of[id(flat.params[0])]].sum()))
        states.append(flat.state.name)
        try:
            flat.params[0].data  # noqa: B018 (the read under test)
            read_while_sharded = "no error"
        except ShardedParameterError as error:
            read_while_sharded = str(error)
        flat.start_unshard()
        states.append(flat.state.name)
        flat.unshard()
        states.append(flat.state.name)
        whole_values = all(torch.equal(param.detach(), whole[name_of[id(param)]]) for param in flat.params)
        gathered_bytes = flat.storage.full.resident_bytes
        flat.reshard()
        states.append(flat.state.name)
        with flat.gathered():
            states.append(flat.state.name)
        states.append(flat.state.name)
        walked.append({
            "names": [name_of[id(param)] for param in flat.params], "states": states, "whole_values": whole_values,
            "sharded_bytes": sharded_bytes, "gathered_bytes": gathered_bytes,
            "full_bytes": flat.spec.layout.padded_numel * 4, "read_while_sharded": read_while_sharded,
            "read_sum": read_sum,
        })
    engine.release(full=True)
    return walked


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_a_stage3_flat_param_moves_through_its_states_and_gathers_every_slice(world: int) -> None:
    ranks = run_in_process(_parameter_lifecycle, world, timeout_s=20)
    assert len(ranks[0]) >= 2, "the model's Linear layers make several units that stage 3 frees between uses"
    for rank, walked in enumerate(ranks):
        for flat in walked:
            assert flat["states"] == ["SHARDED", "SHARDED", "GATHERING", "UNSHARDED", "SHARDED", "UNSHARDED",
                                      "SHARDED"], rank
            assert flat["read_sum"], f"rank {rank}: a read outside forward gives the whole parameter's values"
            assert flat["whole_values"], f"rank {rank}: gathered {flat['names']} differ from the whole parameters"
            assert (flat["sharded_bytes"], flat["gathered_bytes"]) == (0, flat["full_bytes"]), rank
            assert flat["names"][0] in flat["read_while_sharded"], flat["read_while_sharded"]
            assert "gathered_parameters()" in flat["read_while_sharded"], flat["read_while_sharded"]


def _step_phases(rank: int, world: int, stage: int) -> dict:
    """A backward, then the step calls out of order and in order; the phase after each, the errors' messages."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, min_unit_numel=100))
    phase = lambda: engine.windows.steps[0].phase.name  # noqa: E731
    _loss(model, rank).backward()
    seen: dict = {"errors": {}, "phases": [phase()]}
    with pytest.raises(StepOrderError) as outside:
        engine.step(optimizer)
    seen["errors"]["step outside the window"] = str(outside.value)
    seen["phases"].append(phase())
    with engine.step_window(optimizer):
        seen["phases"].append(phase())
        with pytest.raises(StepOrderError) as twice:
            with engine.step_window(optimizer):
                pass
        seen["errors"]["the window entered twice"] = str(twice.value)
        engine.step(optimizer)
    seen["phases"].append(phase())
    optimizer.zero_grad()
    _loss(model, rank).backward()
    engine.optimizer_step(optimizer)  # the refused calls changed nothing: the run goes on
    engine.release(full=True)
    seen["weights"] = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return seen


def _same_steps_in_order(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, min_unit_numel=100))
    for _ in range(2):
        optimizer.zero_grad()
        _loss(model, rank).backward()
        engine.optimizer_step(optimizer)
    engine.release(full=True)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_call_in_the_wrong_phase_is_an_error_naming_it_and_changes_nothing(stage: int) -> None:
    ranks = run_in_process(_step_phases, 2, stage, timeout_s=20)
    reference = run_in_process(_same_steps_in_order, 2, stage, timeout_s=20)
    for rank, seen in enumerate(ranks):
        assert seen["phases"] == ["ACCUMULATING", "ACCUMULATING", "STEPPING", "ACCUMULATING"], rank
        assert "cannot step the optimizer while optimizer 0 (SGD) is ACCUMULATING" in \
            seen["errors"]["step outside the window"]
        assert "cannot enter the step window while optimizer 0 (SGD) is STEPPING" in \
            seen["errors"]["the window entered twice"]
        for name, value in reference[rank].items():
            assert torch.equal(seen["weights"][name], value), f"rank {rank}: {name} differs from the in-order run"
