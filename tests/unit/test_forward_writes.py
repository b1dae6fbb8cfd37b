"""The mode that refuses a write into a host-wide parameter buffer inside forward (core/runtime/forward_writes.py),
in one process on stand-ins of two FlatParams: which writes it refuses (by address: the parameter, strided views,
out=, inplace=True, a list of torch._foreach_*_ ), what it lets through (activations, ZeRO's own views of the buffer,
master pieces, calls that change no values), and that it leaves the stack as it found it. The reference is the
buffer's values before each call: a refused write leaves them unchanged. The processes that share such buffers are
tests/distributed/test_in_place_changes.py's."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from zero_strategy.core.flat.errors import ShardedParameterError
from zero_strategy.core.runtime.forward_writes import ForwardWrites


def _flat(names: list[str], shapes: list[tuple[int, ...]]) -> tuple[Any, list[nn.Parameter]]:
    """A FlatParam stand-in: one buffer (a view of a larger tensor, as a mapped file is), parameters pointing at
    their spans, one master piece (this rank's half)."""
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    full = torch.arange(float(numel + 3))[:numel]
    spans, params, offset = [], [], 0
    for name, shape in zip(names, shapes, strict=True):
        size = torch.Size(shape).numel()
        spans.append(SimpleNamespace(name=name, offset=offset, end=offset + size, shape=shape))
        param = nn.Parameter(torch.empty(0))
        param.data = full[offset : offset + size].view(shape)
        params.append(param)
        offset += size
    piece = nn.Parameter(full[: numel // 2])
    storage = SimpleNamespace(full=SimpleNamespace(tensor=full, readable_in_place=True))
    flat = SimpleNamespace(storage=storage, names=names, layout=SimpleNamespace(spans=spans),
                           master_pieces=[piece], label="unit")
    return flat, params


@pytest.fixture
def setup() -> tuple[ForwardWrites, list[Any], list[nn.Parameter]]:
    first, first_params = _flat(["a.weight", "a.bias"], [(3, 4), (4,)])
    second, second_params = _flat(["b.weight"], [(5, 2)])
    mode = ForwardWrites.for_flats([first, second])
    assert mode is not None
    return mode, [first, second], first_params + second_params


REFUSED: dict[str, tuple[Callable[[list[nn.Parameter]], object], str]] = {
    "clamp_": (lambda p: p[0].clamp_(0, 1), "a.weight"),
    "column view": (lambda p: p[0][:, 1].zero_(), "a.weight"),
    "p.data": (lambda p: p[1].data.mul_(2), "a.bias"),
    "p.detach()": (lambda p: p[2].detach().view(-1)[3:5].fill_(0), "b.weight"),
    "setitem": (lambda p: p[2].__setitem__(0, 7.0), "b.weight"),
    "out=": (lambda p: torch.add(p[1], 1, out=p[1]), "a.bias"),
    "inplace=True": (lambda p: nn.functional.relu(p[0], inplace=True), "a.weight"),
    "foreach": (lambda p: torch._foreach_mul_([torch.ones(2), p[2]], 2.0), "b.weight"),
    "nn.init": (lambda p: nn.init.zeros_(p[1]), "a.bias"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_write_into_a_buffer_is_refused_before_it_lands(setup: Any, case: str) -> None:
    mode, flats, params = setup
    write, name = REFUSED[case]
    before = [flat.storage.full.tensor.clone() for flat in flats]
    mode.enter()
    try:
        with torch.no_grad(), pytest.raises(ShardedParameterError, match=rf"{name} changed in place .*refused before"):
            write(params)
    finally:
        mode.exit()
    for flat, values in zip(flats, before, strict=True):
        assert torch.equal(flat.storage.full.tensor, values), f"{case}: the buffer changed"
    assert torch.overrides._get_current_function_mode_stack() == []


@pytest.mark.timeout(30)
def test_zeros_own_writes_activations_and_flags_pass(setup: Any) -> None:
    mode, flats, params = setup
    full = flats[0].storage.full.tensor
    activation = torch.ones(4)
    mode.enter()
    mode.enter()  # nested (a recomputation inside the entry's forward): one push
    try:
        with torch.no_grad():
            activation.relu_().mul_(3)
            nn.functional.relu(activation, inplace=True)
            full[2:4].copy_(torch.tensor([-1.0, -2.0]))  # ZeRO's own view of the buffer (a load, a release)
            flats[0].master_pieces[0].add_(10)  # a master piece (an optimizer step inside training_step)
        params[0].requires_grad_(False)
    finally:
        mode.exit()
        assert len(torch.overrides._get_current_function_mode_stack()) == 1
        mode.exit()
    assert torch.overrides._get_current_function_mode_stack() == []
    expected = torch.arange(16.0)
    expected[2:4] = torch.tensor([-1.0, -2.0])
    expected[:8] += 10
    assert torch.equal(full, expected)
    assert torch.equal(activation, torch.full((4,), 3.0))
    with torch.no_grad():  # the mode is gone: the same write goes through
        params[1].zero_()
    assert float(full[12:].abs().sum()) == 0.0


@pytest.mark.timeout(30)
def test_no_mode_without_a_host_wide_buffer() -> None:
    flat, _ = _flat(["a.weight"], [(2, 2)])
    flat.storage.full.readable_in_place = False
    assert ForwardWrites.for_flats([flat]) is None
