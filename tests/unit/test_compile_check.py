"""Stage 3 tells the user where torch.compile's graph will break: a compiled module with units inside it (each
unit's gather is a collective dynamo cannot trace). Compiling nothing runs here: ``compile()`` is lazy."""

from __future__ import annotations

import warnings

import torch
from helpers.models import make_model
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.runtime.compile_check import CompiledAroundUnitsWarning


def _shard(module: nn.Module, stage: int, **options: object) -> list[str]:
    """Shard ``module`` on one rank; the messages of the CompiledAroundUnitsWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ZeroEngine(module, [torch.optim.SGD(module.parameters(), lr=0.1)], ZeroConfig(stage=stage, **options))
    engine.release()
    return [str(w.message) for w in caught if issubclass(w.category, CompiledAroundUnitsWarning)]


class Holder(nn.Module):
    """A LightningModule's shape: the network as an attribute, compiled with ``torch.compile``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(make_model())


def test_compiled_units_themselves_give_no_warning() -> None:
    model = make_model()
    for block in model.blocks:
        block.compile()
    assert _shard(model, stage=3) == []


def test_whole_model_compiled_around_units_is_named_at_stage_3_only() -> None:
    messages = _shard(Holder(), stage=3)
    assert len(messages) == 1, messages
    assert "'net'" in messages[0] and "'net._orig_mod.blocks.0'" in messages[0], messages[0]
    assert "block.compile()" in messages[0]
    assert _shard(Holder(), stage=1) == []  # stages 1/2 gather nothing in forward


def test_a_unit_nested_in_a_compiled_block_is_named() -> None:
    model = make_model()
    for block in model.blocks:
        block.compile()
    messages = _shard(model, stage=3, unit_modules=["Block", "Linear"])
    assert len(messages) == len(model.blocks), messages
    assert "'blocks.0'" in messages[0] and "'blocks.0.fc'" in messages[0], messages[0]
