"""The one gather of a whole FlatParam (core/flat/whole.py) and its inverse, on 1 to 4 ranks simulated by threads:
``gather_whole`` + ``param_views`` give every parameter's whole values from the slices (in the gathered tensor's
own dtype, for any tensor laid out like the slice), through the FlatParam's own Comm;
``own_parts`` cuts exactly this rank's ranges out of a whole parameter. Reference: the module's parameters as
built, read before the engine shards them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.core.flat.whole import gather_whole, own_parts, param_views
from zero_strategy.testing import run_in_process


def _model() -> nn.Module:
    """Values from a generator of its own (the simulated ranks are threads sharing torch's global one); odd sizes,
    so that slices end inside parameters and the last one is padded."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    values = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=values))
    return model


def _gather_and_cut(rank: int, world: int) -> dict:
    model = _model()
    reference = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine = ZeroEngine(model, [], ZeroConfig(stage=3, min_unit_numel=1))
    got: dict = {"whole": {}, "doubled": {}, "cut": {}}
    for flat in engine.flat_params:
        whole = gather_whole(flat, flat.shard, "test")
        got["whole"].update((name, values.clone()) for name, values in param_views(flat, whole))
        doubled = gather_whole(flat, (flat.shard * 2).to(torch.float64), "test, another dtype")
        got["doubled"].update((name, values.clone()) for name, values in param_views(flat, doubled))
        for name in flat.names:
            for overlap, part in own_parts(flat, name, reference[name]):
                shard_part = flat.shard[overlap.shard_start : overlap.shard_start + overlap.numel]
                got["cut"][(name, overlap.param_start)] = (part.clone(), shard_part.clone())
    got["reference"] = reference
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_whole_flat_params_from_their_slices_and_back(world):
    ranks = run_in_process(_gather_and_cut, world, timeout_s=30)
    reference = ranks[0]["reference"]
    for rank, got in enumerate(ranks):
        assert set(got["whole"]) == set(reference), rank
        for name, expected in reference.items():
            assert torch.equal(got["whole"][name], expected), (rank, name)  # equal fails on NaN
            assert got["doubled"][name].dtype == torch.float64, (rank, name)
            assert torch.equal(got["doubled"][name], (expected * 2).to(torch.float64)), (rank, name)
        for (name, start), (part, shard_part) in got["cut"].items():
            assert torch.equal(part, shard_part), (rank, name, start)  # the rank's own range, where it keeps it
    # every element of every parameter is cut by exactly one rank
    for name, expected in reference.items():
        covered = torch.zeros(expected.numel(), dtype=torch.int64)
        for got in ranks:
            for (cut_name, start), (part, _) in got["cut"].items():
                if cut_name == name:
                    covered[start : start + part.numel()] += 1
        assert torch.equal(covered, torch.ones_like(covered)), name
