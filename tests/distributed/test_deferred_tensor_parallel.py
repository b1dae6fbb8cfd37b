"""The recording of a build on the meta device followed by a tensor-parallel plan (see [Note: tensor-parallel
parameters built on the meta device] in core/init/distributed_origins.py), on a one-rank TP mesh: each DTensor
parameter's replayed value is the whole tensor it was distributed from, bit for bit the eager build's; a DTensor
distributed outside the recording, or whose origin the build changed after the plan, is refused by name."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.compare import assert_state_close
from helpers.tp_toy import ToyNet, apply_plan, make_model
from torch.distributed.device_mesh import init_device_mesh

from zero_strategy.core.init import DeferredInitError, ModuleReplay, Recording, record_construction
from zero_strategy.testing import run_ranks


def replayed_and_refused(rank: int, world: int) -> tuple[dict[str, torch.Tensor], str]:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
    with record_construction() as recording:
        torch.manual_seed(0)
        net = ToyNet()
        apply_plan(net, mesh)
    replay = ModuleReplay(recording, net)
    values: dict[str, torch.Tensor] = {}
    replay.replay(lambda final, value: values.update({name: value.clone() for name in final.names}))
    with record_construction() as recording:
        late = ToyNet()
    apply_plan(late, mesh)  # outside the recording: no origin noted
    return values, _refusal(recording, late)


def _refusal(recording: Recording, module: torch.nn.Module) -> str:
    try:
        ModuleReplay(recording, module)
    except DeferredInitError as error:
        return str(error)
    return "no error"


def origin_changed_after_the_plan(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
    with record_construction() as recording:
        net = ToyNet()
        replaced = net.out.weight
        apply_plan(net, mesh)
        torch.nn.init.zeros_(replaced)  # the DTensor made from it before does not hold these values
    return _refusal(recording, net)


@pytest.mark.timeout(120)
def test_each_dtensor_parameter_replays_its_origin_and_one_without_is_refused() -> None:
    [(values, message)] = run_ranks(replayed_and_refused, 1, timeout_s=100)
    eager = {name: param.detach() for name, param in make_model().named_parameters()}
    assert_state_close(values, eager, rel=0.0, what="replayed origins vs the eager build")
    assert re.search(r"emb\.weight is a tensor-parallel \(DTensor\) parameter on the meta device that was not "
                     r"distributed from a parameter built inside the recording", message), message


@pytest.mark.timeout(120)
def test_a_parameter_changed_after_the_plan_distributed_it_is_refused() -> None:
    [message] = run_ranks(origin_changed_after_the_plan, 1, timeout_s=100)
    assert re.search(r"out\.weight was changed after the tensor-parallel plan distributed it", message), message
