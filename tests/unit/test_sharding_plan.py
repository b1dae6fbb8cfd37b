"""Unit choice and parameter assignment: ModuleList children, size threshold, explicit classes, tied weights."""

from __future__ import annotations

import pytest
import torch
from helpers.models import TiedLM, make_model
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.plan.units import choose_unit_modules, plan_units

BIG = 10**9


def _ids(named):
    return [id(p) for _, p in named]


def _assert_each_param_once(root: nn.Module, plans) -> None:
    stored = [id(p) for plan in plans for _, p in plan.named_params]
    assert len(stored) == len(set(stored)), "a parameter is stored in two units"
    assert set(stored) == {id(p) for p in root.parameters()}, "a parameter is stored in no unit"


@pytest.mark.timeout(10)
def test_modulelist_children_become_units():
    model = TiedLM(n_blocks=3)
    assert choose_unit_modules(model, [], BIG) == ["", "blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.timeout(10)
def test_nested_modulelist_and_parameterless_children():
    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Enc()
            self.out = nn.Linear(3, 1)

    # the ReLU has no parameters: gathering or freeing it would be pointless, so it is no unit
    assert choose_unit_modules(Net(), [], BIG) == ["", "encoder.layers.0", "encoder.layers.2"]


@pytest.mark.timeout(10)
def test_size_threshold():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.Linear(2, 2)  # 6 elements
            self.big = nn.Linear(10, 10)  # 110 elements
            self.seq = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))  # 30 + 30 elements

    assert choose_unit_modules(Net(), [], 100) == ["", "big"]
    assert choose_unit_modules(Net(), [], 60) == ["", "big", "seq"]
    assert choose_unit_modules(Net(), [], 30) == ["", "big", "seq.0", "seq.1"]
    assert choose_unit_modules(Net(), [], BIG) == [""]


@pytest.mark.timeout(10)
def test_explicit_unit_classes_replace_automatic_choice():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Sequential(Layer())  # a Layer outside any ModuleList
            self.lst = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    assert choose_unit_modules(Net(), ["Layer"], BIG) == ["", "pre.0"]
    assert choose_unit_modules(Net(), [], BIG) == ["", "lst.0", "lst.1"]
    assert choose_unit_modules(Net(), ["Layer", "Linear"], BIG) == ["", "pre.0", "pre.0.fc", "lst.0", "lst.1"]


@pytest.mark.timeout(10)
def test_plan_assigns_block_params_to_their_block_and_tied_weight_to_root():
    model = TiedLM(n_blocks=3)
    paths = choose_unit_modules(model, [], BIG)
    plans = {plan.name: plan for plan in plan_units(model, paths)}
    _assert_each_param_once(model, plans.values())
    for i, block in enumerate(model.blocks):
        assert set(_ids(plans[f"blocks.{i}"].named_params)) == {id(p) for p in block.parameters()}
        assert plans[f"blocks.{i}"].module is block
    root_ids = _ids(plans[""].named_params)
    assert root_ids.count(id(model.emb.weight)) == 1  # the tied weight is stored once
    assert set(root_ids) == {id(model.emb.weight), id(model.ln_f.weight), id(model.ln_f.bias)}
    assert "emb.weight" in [name for name, _ in plans[""].named_params]


@pytest.mark.timeout(10)
def test_tied_between_sibling_units_goes_to_common_ancestor_unit():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.layers[1].fc.weight = self.layers[0].fc.weight

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Encoder()
            self.out = nn.Linear(4, 1)

    model = Net()
    paths = choose_unit_modules(model, ["Encoder", "Layer"], BIG)
    assert paths == ["", "encoder", "encoder.layers.0", "encoder.layers.1"]
    plans = {plan.name: plan for plan in plan_units(model, paths)}
    _assert_each_param_once(model, plans.values())
    shared = id(model.encoder.layers[0].fc.weight)
    assert shared in _ids(plans["encoder"].named_params)  # innermost unit containing both users
    assert shared not in _ids(plans["encoder.layers.0"].named_params)
    assert set(_ids(plans["encoder.layers.1"].named_params)) == {id(model.encoder.layers[1].fc.bias)}


@pytest.mark.timeout(10)
def test_tied_inside_one_unit_stays_in_that_unit():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

    model = Net()
    plans = {plan.name: plan for plan in plan_units(model, choose_unit_modules(model, [], BIG))}
    _assert_each_param_once(model, plans.values())
    assert "" not in plans  # the root owns nothing
    assert _ids(plans["blocks.0"].named_params).count(id(model.blocks[0].a.weight)) == 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_keeps_tied_weight_tied_and_stored_once(stage):
    model = make_model()
    n_distinct = sum(p.numel() for p in model.parameters())
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=stage))
    assert model.head.weight is model.emb.weight
    assert sum(fp.layout.numel for fp in engine.flat_params) == n_distinct
    with engine.gathered_parameters():
        state = model.state_dict()
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0)
