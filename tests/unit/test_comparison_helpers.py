"""Every comparison helper of the tests fails on what it must not let through: a NaN or inf in the result, a NaN in
the reference, a key missing or extra, a changed shape (and dtype, for state dicts); and passes what is close.

A helper that silently keeps ``worst`` when ``err`` is NaN (``nan > worst`` is False) turns every parity test that
uses it into one that cannot fail on a diverged run: each helper gets each broken input here.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import compare
from helpers.models import assert_state_close as assert_state_close_from_models
from torch import Tensor

TESTS = Path(__file__).resolve().parents[1]
StateCheck = Callable[[dict[str, Tensor], dict[str, Tensor]], None]


def _reference() -> dict[str, Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(3, 4), "b": torch.randn(4)}


def _poisoned(state: dict[str, Tensor], key: str, value: float) -> dict[str, Tensor]:
    out = {k: v.clone() for k, v in state.items()}
    out[key].view(-1)[1] = value
    return out


def _broken_pairs() -> dict[str, tuple[dict[str, Tensor], dict[str, Tensor]]]:
    """(result, reference) pairs, each broken in one way; the reference is otherwise the result exactly."""
    ref = _reference()
    every_nan = {k: torch.full_like(v, math.nan) for k, v in ref.items()}
    return {
        "nan in result": (_poisoned(ref, "w", math.nan), ref),
        "all nan result": (every_nan, ref),
        "inf in result": (_poisoned(ref, "b", math.inf), ref),
        "-inf in result": (_poisoned(ref, "b", -math.inf), ref),
        "nan in reference": (ref, _poisoned(ref, "w", math.nan)),
        "inf in reference": (ref, _poisoned(ref, "w", math.inf)),
        "inf on both sides": (_poisoned(ref, "w", math.inf), _poisoned(ref, "w", math.inf)),
        "missing key": ({"w": ref["w"]}, ref),
        "extra key": ({**ref, "extra": torch.zeros(1)}, ref),
        "shape change": ({"w": ref["w"].reshape(4, 3), "b": ref["b"]}, ref),
        "flattened": ({"w": ref["w"].reshape(-1), "b": ref["b"]}, ref),
    }


def _by_rel(check: Callable[..., None]) -> StateCheck:
    return lambda got, ref: check(got, ref, rel=1.0)


def _load(path: str) -> ModuleType:
    """A test module by its file (``lightning/`` and ``cuda/`` would be shadowed by installed packages); its folder
    is on ``sys.path`` while it loads, as pytest has it when it collects that folder (siblings by bare name)."""
    file = TESTS / path
    spec = importlib.util.spec_from_file_location(f"_compared_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(file.parent))
    return module


def _ranks_close(got: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    _load("checkpoint/ckpt_workers.py").ranks_close([ref, got], ref, "test")  # rank 0 fine, rank 1 broken


def _dcp_assert_close(got: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    _load("checkpoint/dcp_workers.py").assert_close(got, ref, 1.0, "test")


def _max_abs_err(got: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    err, _ = compare.max_abs_err(got, ref)
    assert err <= 1e9


def _max_rel_err(got: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    err, _ = compare.max_rel_err(got, ref)
    assert err <= 1e9


def _cuda_worker_updates(got: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    initial = {k: torch.zeros_like(v) for k, v in _reference().items()}
    _load("cuda/worker.py").assert_updates_match(got, ref, initial, 1.0, "test")


# a generous tolerance everywhere: what must fail is the broken input, not a tight limit
STATE_HELPERS: dict[str, StateCheck] = {
    "compare.assert_state_close": _by_rel(compare.assert_state_close),
    "models.assert_state_close (re-export)": _by_rel(assert_state_close_from_models),
    "compare.max_rel_err": _max_rel_err,
    "compare.max_abs_err": _max_abs_err,
    "ckpt_workers.ranks_close": _ranks_close,
    "dcp_workers.assert_close": _dcp_assert_close,
    "cuda worker assert_updates_match": _cuda_worker_updates,
}


@pytest.mark.parametrize("helper", list(STATE_HELPERS))
@pytest.mark.parametrize("broken", list(_broken_pairs()))
def test_state_helpers_fail_on_broken_input(helper: str, broken: str) -> None:
    got, ref = _broken_pairs()[broken]
    with pytest.raises(AssertionError):
        STATE_HELPERS[helper](got, ref)


@pytest.mark.parametrize("helper", list(STATE_HELPERS))
def test_state_helpers_pass_close_states(helper: str) -> None:
    ref = _reference()
    got = {k: v * (1 + 1e-7) for k, v in ref.items()}
    STATE_HELPERS[helper](got, ref)


def test_a_dtype_change_fails_unless_the_caller_says_it_is_deliberate() -> None:
    ref = _reference()
    doubled = {k: v.double() for k, v in ref.items()}
    with pytest.raises(AssertionError, match="dtype"):
        compare.assert_state_close(doubled, ref)
    compare.assert_state_close(doubled, ref, dtype=False)


def test_the_limits_still_bite_on_finite_values() -> None:
    ref = _reference()
    off = {k: v.clone() for k, v in ref.items()}
    off["b"][0] += 1e-3 * ref["b"].abs().max()
    with pytest.raises(AssertionError, match="b differs"):
        compare.assert_state_close(off, ref, rel=1e-5)
    compare.assert_state_close(off, ref, rel=2e-3)
    assert compare.max_rel_err(off, ref) == (pytest.approx(1e-3, rel=1e-3), "b")
    with pytest.raises(AssertionError):
        # one element one float32 step away: rel=0 means bit-identical
        nudged = ref["w"].clone()
        nudged.view(-1)[0] = torch.nextafter(nudged.view(-1)[0], torch.tensor(math.inf))
        compare.assert_state_close(ref | {"w": nudged}, ref, rel=0.0)
    compare.assert_state_close({k: v.clone() for k, v in ref.items()}, ref, rel=0.0)


def test_the_error_names_the_tensor_and_the_side() -> None:
    ref = _reference()
    with pytest.raises(AssertionError, match=r"run 7: w: the result holds 1 non-finite value"):
        compare.assert_state_close(_poisoned(ref, "w", math.nan), ref, what="run 7")
    with pytest.raises(AssertionError, match=r"w: the reference holds 1 non-finite"):
        compare.assert_state_close(ref, _poisoned(ref, "w", math.inf))
    with pytest.raises(AssertionError, match=r"missing \['b'\], extra \['c'\]"):
        compare.assert_state_close({"w": ref["w"], "c": ref["b"]}, ref)


# --- sequences of numbers (loss curves, metrics) -------------------------------------------------------------

LOSSES = [2.4, 2.1, 1.9, 1.7]
BROKEN_SEQUENCES: dict[str, tuple[list[float], list[float]]] = {
    "nan in result": ([2.4, math.nan, 1.9, 1.7], LOSSES),
    "inf in result": ([2.4, 2.1, math.inf, 1.7], LOSSES),
    "-inf in result": ([2.4, 2.1, 1.9, -math.inf], LOSSES),
    "nan in reference": (LOSSES, [2.4, 2.1, math.nan, 1.7]),
    "inf in reference": (LOSSES, [math.inf, 2.1, 1.9, 1.7]),
    "one missing": (LOSSES[:-1], LOSSES),
    "one extra": ([*LOSSES, 1.6], LOSSES),
}


def _values_close(got: list[float], ref: list[float]) -> None:
    compare.assert_values_close(got, ref, rel=1.0)


def _max_rel_diff(got: list[float], ref: list[float]) -> None:
    assert compare.max_rel_diff(got, ref) <= 1e9


def _max_rel_diff_to_the_value(got: list[float], ref: list[float]) -> None:
    assert compare.max_rel_diff(got, ref, floor=compare.ZERO_FLOOR) <= 1e9


SEQUENCE_HELPERS: dict[str, Callable[[list[float], list[float]], None]] = {
    "assert_values_close": _values_close,
    "max_rel_diff": _max_rel_diff,
    "max_rel_diff relative to the value": _max_rel_diff_to_the_value,
}


@pytest.mark.parametrize("helper", list(SEQUENCE_HELPERS))
@pytest.mark.parametrize("broken", list(BROKEN_SEQUENCES))
def test_sequence_helpers_fail_on_broken_input(helper: str, broken: str) -> None:
    got, ref = BROKEN_SEQUENCES[broken]
    with pytest.raises(AssertionError):
        SEQUENCE_HELPERS[helper](got, ref)


def test_sequence_helpers_pass_close_values_and_bite_on_far_ones() -> None:
    compare.assert_values_close([v + 1e-6 for v in LOSSES], LOSSES, rel=1e-5)
    with pytest.raises(AssertionError, match="limit"):
        compare.assert_values_close([v * 1.01 for v in LOSSES], LOSSES, rel=1e-3)
    # relative to the value itself: 1 % of a loss of 0.1 is 1e-3, well over a 1e-4 limit; with the default floor
    # of 1 the same difference is an absolute 1e-3
    assert compare.max_rel_diff([0.101], [0.1], floor=compare.ZERO_FLOOR) == pytest.approx(1e-2)
    assert compare.max_rel_diff([0.101], [0.1]) == pytest.approx(1e-3)
    for bad in (math.nan, math.inf):
        with pytest.raises(AssertionError):
            compare.rel_diff(bad, 1.0)
        with pytest.raises(AssertionError):
            compare.rel_diff(1.0, bad)


# --- a reference that legitimately overflows -----------------------------------------------------------------


def test_same_non_finite_positions_pass_and_any_other_fails() -> None:
    ref = torch.tensor([1.0, math.inf, -math.inf, math.nan])
    compare.assert_same_non_finite(ref.clone(), ref, "x")
    for got in (
        torch.tensor([1.0, math.inf, -math.inf, 0.0]),  # a NaN lost
        torch.tensor([1.0, -math.inf, -math.inf, math.nan]),  # a sign flipped
        torch.tensor([math.nan, math.inf, -math.inf, math.nan]),  # a NaN more
        torch.tensor([1.0, math.inf, -math.inf]),  # a shape change
    ):
        with pytest.raises(AssertionError):
            compare.assert_same_non_finite(got, ref, "x")


# --- the Lightning statistics comparison (test_broadcast_buffers) --------------------------------------------


def test_broadcast_buffers_close_fails_on_broken_statistics() -> None:
    buffers = _load("lightning/test_broadcast_buffers.py")
    stats, close = buffers.STATS, buffers._close
    ref = {k: torch.rand(5) + 0.5 for k in stats}
    assert close({k: v.clone() for k, v in ref.items()}, ref)
    for key in stats:
        for value in (math.nan, math.inf):
            with pytest.raises(AssertionError):
                close(_poisoned(ref, key, value), ref)
            with pytest.raises(AssertionError):
                close(ref, _poisoned(ref, key, value))
        with pytest.raises(AssertionError):
            close({k: v for k, v in ref.items() if k != key}, ref)
        with pytest.raises(AssertionError):
            close(ref | {key: ref[key][:4]}, ref)
    with pytest.raises(AssertionError):
        close(ref | {"extra": torch.zeros(1)}, ref)
    assert not close(ref | {stats[0]: ref[stats[0]] + 1.0}, ref)
