"""Tensors a meta-built module holds besides parameters and buffers (torchmetrics states and their defaults, plain
tensor attributes, tensors in lists, tuples and dicts) get the values an eager build gives, in place: the containers
and tensor objects that code holds keep their identity, views stay views, and the metrics work afterwards."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torchmetrics
from torch import Tensor, nn

from zero_strategy.core.init import DeferredInitError, ModuleReplay, materialize_module, record_construction

SEED = 77
CLASSES = 5


class WithMetrics(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, CLASSES)
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.mean = torchmetrics.MeanMetric()
        self.cat = torchmetrics.CatMetric()  # a list state: [] in the attribute and in `_defaults`
        self.count = torch.zeros((), dtype=torch.int64)
        self.noise = torch.rand(4)  # drawn between parameter inits: its draws count
        self.table = [torch.stack([torch.arange(3.0), -torch.arange(3.0)]), {"ones": torch.ones(2)}, (torch.ones(2),)]
        self.first_row = self.table[0][0]  # a view of another attribute tensor (which is no view itself)
        self.head = nn.Linear(CLASSES, 2)


def _build(record: bool) -> tuple[WithMetrics, Any]:
    torch.manual_seed(SEED)
    if not record:
        return WithMetrics(), None
    with torch.device("cpu"), record_construction() as recording:  # Lightning builds under torch.device(root)
        model = WithMetrics()
    return model, recording


def _attribute_tensors(model: WithMetrics) -> dict[str, Tensor]:
    """Every tensor the module holds outside parameters and buffers, by where it is."""
    return {
        "acc.tp": model.acc.tp,
        "acc.fn": model.acc.fn,
        "acc._defaults.tp": model.acc._defaults["tp"],
        "mean.mean_value": model.mean.mean_value,
        "mean.weight": model.mean.weight,
        "mean._defaults.weight": model.mean._defaults["weight"],
        "count": model.count,
        "noise": model.noise,
        "table[0]": model.table[0],
        "table[1].ones": model.table[1]["ones"],
        "table[2][0]": model.table[2][0],
        "first_row": model.first_row,
    }


def test_attribute_tensors_get_the_eager_values_in_place() -> None:
    eager, _ = _build(record=False)
    model, recording = _build(record=True)
    before = _attribute_tensors(model)
    assert all(t.is_meta for t in before.values())
    containers = (model.table, model.table[1], model.acc._defaults, model.cat.value, model.cat._defaults["value"])
    materialize_module(model, recording)
    after, expected = _attribute_tensors(model), _attribute_tensors(eager)
    for name, value in expected.items():
        assert not after[name].is_meta, name
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name
        assert after[name] is before[name], f"{name}: the tensor object code holds keeps its identity"
    again = (model.table, model.table[1], model.acc._defaults, model.cat.value, model.cat._defaults["value"])
    assert all(a is b for a, b in zip(containers, again, strict=True)), "containers keep their identity"
    assert torch.equal(model.head.weight, eager.head.weight), "the attribute tensor's random draw is replayed in order"
    model.first_row.fill_(-1.0)
    assert torch.equal(model.table[0][0], torch.full((3,), -1.0)), "a view of an attribute tensor stays a view of it"
    assert model.acc.device == eager.acc.device == torch.device("cpu")


def test_metrics_built_on_meta_compute_reset_and_move_afterwards() -> None:
    model, recording = _build(record=True)
    materialize_module(model, recording)
    eager, _ = _build(record=False)
    preds, target = torch.randn(8, CLASSES), torch.randint(0, CLASSES, (8,))
    for metric in (model, eager):
        metric.acc.update(preds, target)
        metric.mean.update(torch.tensor([1.0, 3.0]))
        metric.cat.update(torch.tensor([2.0]))
    assert model.acc.compute() == eager.acc.compute()
    assert model.mean.compute() == eager.mean.compute() == 2.0
    assert torch.equal(model.cat.compute(), eager.cat.compute())
    model.acc.reset()
    model.cat.reset()
    assert torch.equal(model.acc.tp, eager.acc._defaults["tp"]) and not model.acc.tp.is_meta
    assert model.cat.value == []
    model.cpu()  # Lightning's teardown: Metric._apply moves states and defaults
    model.to(torch.float64)


class ViewOfAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.first_row = self.lin.weight[0]


def test_an_attribute_tensor_viewing_a_parameter_is_a_clear_error() -> None:
    with record_construction() as recording:
        model = ViewOfAParameter()
    with pytest.raises(DeferredInitError, match=r"first_row is a view of parameter lin.weight.*buffer"):
        ModuleReplay(recording, model)


def test_meta_tensors_made_before_the_build_stay_meta() -> None:
    """An eager build leaves a tensor made on the meta device on purpose as it is; so does replay."""
    probe = torch.empty(3, device="meta")
    with record_construction() as recording:
        model = nn.Linear(2, 2)
    model.probe = probe
    materialize_module(model, recording)
    assert model.probe.is_meta and not model.weight.is_meta


class ViewHiddenInAnObject(nn.Module):
    """A view of an attribute tensor kept inside an object no walk looks into: the base cannot be swapped in place."""

    def __init__(self, in_tuple: bool) -> None:
        super().__init__()
        base = torch.stack([torch.arange(3.0), torch.ones(3)])
        self.hidden = SimpleNamespace(view=base[0])
        if in_tuple:
            self.pair = (base,)
        else:
            self.base, self.listed = base, [base]


def test_an_attribute_tensor_something_else_refers_to_gets_its_value_where_it_was_found() -> None:
    with record_construction() as recording:
        model = ViewHiddenInAnObject(in_tuple=False)
    materialize_module(model, recording)
    expected = torch.stack([torch.arange(3.0), torch.ones(3)])
    assert torch.equal(model.base, expected) and model.listed[0] is model.base
    assert model.hidden.view.is_meta, "tensors inside other objects are not materialized (documented limit)"
    with record_construction() as recording:
        model = ViewHiddenInAnObject(in_tuple=True)
    with pytest.raises(DeferredInitError, match=r"pair\[0\] \(in a tuple\).*views"):
        materialize_module(model, recording)
