"""``zero-estimate --model``: the model is built on the meta device only, never for real
(see [Note: the estimator never builds a model for real] in zero_strategy/estimate/model_spec.py)."""

from __future__ import annotations

import inspect
import re

import pytest
from helpers import estimate_models
from helpers.estimate_models import TENSORS_MADE_ON, PinsItsDevice

from zero_strategy.estimate.cli import main
from zero_strategy.estimate.model_spec import load_model


@pytest.fixture(autouse=True)
def _fresh_record():
    TENSORS_MADE_ON.clear()
    yield
    TENSORS_MADE_ON.clear()


@pytest.mark.timeout(30)
def test_a_constructor_that_cannot_run_on_meta_is_an_error_naming_its_line_and_is_never_built():
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "helpers.estimate_models:SizedByItsOwnTable"])
    message = str(stopped.value)
    source, first = inspect.getsourcelines(estimate_models.SizedByItsOwnTable.__init__)
    line = first + next(i for i, text in enumerate(source) if ".item()" in text)
    assert f"{estimate_models.__file__}:{line}" in message, message  # the user's line, not torch's
    assert ".item()" in message and "meta" in message
    assert "--params" in message  # what the user can do instead
    # only the meta attempt ran: no tensor of a real build, no second (eager) construction
    assert TENSORS_MADE_ON == ["meta"]


@pytest.mark.timeout(30)
def test_explicit_devices_in_the_constructor_stay_on_meta_and_are_counted():
    model = load_model("helpers.estimate_models:PinsItsDevice", '{"width": 24}')
    assert set(TENSORS_MADE_ON) == {"meta"} and len(TENSORS_MADE_ON) == 1 + 2 * 3 + 1
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    eager = PinsItsDevice(width=24)  # small: the count's independent reference
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in eager.named_parameters()]


@pytest.mark.timeout(30)
def test_the_table_of_a_meta_built_model_counts_its_parameters(capsys):
    expected = sum(p.numel() for p in PinsItsDevice(width=24).parameters())
    TENSORS_MADE_ON.clear()
    assert main(["--model", "helpers.estimate_models:PinsItsDevice", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{expected / 1e9:.3g}B parameters, 2 ranks", out), out[:300]
    assert "zero3" in out and set(TENSORS_MADE_ON) == {"meta"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("spec", "kwargs", "words"),
    [
        ("helpers.estimate_models", None, "package.module:ClassName"),
        ("no_such_package_xyz:Model", None, "cannot import 'no_such_package_xyz'"),
        ("helpers.estimate_models:Missing", None, "is nothing, not an nn.Module class"),
        ("helpers.estimate_models:TENSORS_MADE_ON", None, "is list, not an nn.Module class"),
        ("helpers.estimate_models:PinsItsDevice", "{width: 3}", "--model-kwargs is not valid JSON"),
        ("helpers.estimate_models:PinsItsDevice", '{"depth": 3}', "unexpected keyword argument 'depth'"),
    ],
)
def test_bad_model_specs_are_clear_errors(spec, kwargs, words):
    argv = ["--model", spec] + (["--model-kwargs", kwargs] if kwargs else [])
    with pytest.raises(SystemExit, match=re.escape(words)):
        main(argv)


def _tp_local_numel(rank: int, world: int) -> dict[str, int]:
    """The elements this rank holds of each parameter after torch's TP tutorial plan over ``world`` ranks."""
    from helpers.tp_llama import apply_tp_plan, build_llama
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = apply_tp_plan(build_llama(), init_device_mesh("cpu", (world,), mesh_dim_names=("tensor_parallel",)))
    return {name: (p.to_local() if isinstance(p, DTensor) else p).numel() for name, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_tensor_parallel_part_of_a_model_is_what_the_tutorial_plan_leaves_each_rank():
    """The estimate's rule (Linear and Embedding weights split K ways, the rest replicated: [Note: which parameters
    the estimate takes as tensor-parallel] in zero_strategy/estimate/tensor_parallel.py) against the elements each
    rank really holds after ``parallelize_module`` with the tutorial's plan on 2 gloo ranks."""
    from helpers.tp_llama import build_llama

    from zero_strategy.estimate import estimate_memory
    from zero_strategy.testing import run_ranks

    held = run_ranks(_tp_local_numel, 2, timeout_s=50)
    assert held[0] == held[1]
    model = build_llama()
    total = sum(p.numel() for p in model.parameters())
    assert sum(held[0].values()) < 0.6 * total  # the plan did split most of the model
    for world, stage in ((2, 1), (4, 2), (8, 3)):
        e = estimate_memory(model, world_size=world, stage=stage, tensor_parallel=2)
        assert e.num_params == sum(held[0].values())
        # fp32 stages 1/2 alias the masters; AdamW's state: 8 bytes per element of this rank's ZeRO slice
        slices = e.optimizer_state.device / 8
        assert sum(held[0].values()) / (world // 2) <= slices <= sum(held[0].values()) / (world // 2) + 64
    # --tp-fraction replaces the rule: 0 splits nothing (a plan that shards activations only)
    assert estimate_memory(model, world_size=2, stage=1, tensor_parallel=2, tp_fraction=0.0).num_params == total
