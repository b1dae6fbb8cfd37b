"""Comparisons of a result with its reference that every parity test goes through.

Each one fails on what a plain ``max`` or ``if err > worst`` lets through: a NaN or inf on either side (``nan > x``
is False and ``max(x, nan)`` is ``x``, so a NaN would be dropped as "no worse"), a key missing or extra, a shape
change and, for state dicts, a dtype change. A non-finite *reference* is an error too: a comparison with a broken
reference proves nothing. A test whose reference legitimately holds inf or NaN (an overflow test) compares it with
:func:`assert_same_non_finite` first and the finite rest with these helpers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

# below this the reference tensor counts as zero: the relative error is then the absolute one
ZERO_FLOOR = 1e-12


def _label(what: str) -> str:
    return f"{what}: " if what else ""


def assert_same_keys(got: Mapping[str, object], ref: Mapping[str, object], what: str = "") -> None:
    missing = sorted(str(k) for k in ref.keys() - got.keys())
    extra = sorted(str(k) for k in got.keys() - ref.keys())
    assert not missing and not extra, f"{_label(what)}keys differ: missing {missing}, extra {extra}"


def assert_finite(value: Tensor, name: str, side: str, what: str = "") -> None:
    if not value.is_floating_point() and not value.is_complex():
        return
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        count = int(bad.sum())
        first = tuple(int(i) for i in bad.nonzero()[0]) if value.dim() else ()
        raise AssertionError(
            f"{_label(what)}{name}: {side} holds {count} non-finite value(s), the first at {first} "
            f"({value[first].item()})"
        )


def _assert_comparable(got: Tensor, ref: Tensor, name: str, what: str, dtype: bool) -> None:
    """The same shape, the same dtype (unless ``dtype=False``: the caller compares values of a deliberately
    different precision), and both sides finite."""
    assert got.shape == ref.shape, f"{_label(what)}{name}: shape {tuple(got.shape)}, the reference's {tuple(ref.shape)}"
    if dtype:
        assert got.dtype == ref.dtype, f"{_label(what)}{name}: dtype {got.dtype}, the reference's {ref.dtype}"
    assert_finite(got, name, "the result", what)
    assert_finite(ref, name, "the reference", what)


def tensor_rel_err(got: Tensor, ref: Tensor, name: str, what: str = "", dtype: bool = True,
                   floor: float = ZERO_FLOOR) -> float:  # fmt: skip
    """``max|got - ref| / max(max|ref|, floor)`` of one tensor, after :func:`_assert_comparable`."""
    _assert_comparable(got, ref, name, what, dtype)
    if got.numel() == 0:
        return 0.0
    mine, theirs = got.detach().cpu().double(), ref.detach().cpu().double()
    return ((mine - theirs).abs().max() / theirs.abs().max().clamp_min(floor)).item()


def tensor_abs_err(got: Tensor, ref: Tensor, name: str, what: str = "", dtype: bool = True) -> float:
    """``max|got - ref|`` of one tensor, after :func:`_assert_comparable`."""
    _assert_comparable(got, ref, name, what, dtype)
    if got.numel() == 0:
        return 0.0
    return (got.detach().cpu().double() - ref.detach().cpu().double()).abs().max().item()


def max_rel_err(got: Mapping[str, Tensor], ref: Mapping[str, Tensor], what: str = "", dtype: bool = True,
                floor: float = ZERO_FLOOR) -> tuple[float, str]:  # fmt: skip
    """Largest per-tensor ``max|got - ref| / max|ref|`` and the name of the worst tensor (``""`` when none differs)."""
    assert_same_keys(got, ref, what)
    worst, worst_name = 0.0, ""
    for name, value in ref.items():
        err = tensor_rel_err(got[name], value, str(name), what, dtype, floor)
        # every err is finite here (tensor_rel_err refused NaN and inf), so > cannot drop one
        if err > worst:
            worst, worst_name = err, str(name)
    return worst, worst_name


def max_abs_err(got: Mapping[str, Tensor], ref: Mapping[str, Tensor], what: str = "",
                dtype: bool = True) -> tuple[float, str]:  # fmt: skip
    """Largest per-tensor ``max|got - ref|`` and the name of the worst tensor (``""`` when none differs)."""
    assert_same_keys(got, ref, what)
    worst, worst_name = 0.0, ""
    for name, value in ref.items():
        err = tensor_abs_err(got[name], value, str(name), what, dtype)
        if err > worst:
            worst, worst_name = err, str(name)
    return worst, worst_name


def assert_state_close(got: Mapping[str, Tensor], ref: Mapping[str, Tensor], rel: float = 1e-5, what: str = "",
                       dtype: bool = True, floor: float = ZERO_FLOOR) -> None:  # fmt: skip
    """Every tensor within ``rel`` of the reference, relative to the reference tensor's largest value (or ``floor``
    where that is smaller: a tensor near zero is then held to an absolute error)."""
    err, name = max_rel_err(got, ref, what, dtype, floor)
    assert err <= rel, f"{_label(what)}{name} differs from the reference by {err:.2e} (relative), limit {rel:.0e}"


def rel_diff(got: float, ref: float, what: str = "", floor: float = 1.0) -> float:
    """``|got - ref| / max(|ref|, floor)`` of two numbers, both required to be finite (with the default floor a
    reference below 1 is held to an absolute difference)."""
    assert math.isfinite(ref), f"{_label(what)}the reference is {ref}"
    assert math.isfinite(got), f"{_label(what)}the result is {got} (the reference {ref})"
    return abs(got - ref) / max(abs(ref), floor)


def max_rel_diff(got: Sequence[float], ref: Sequence[float], what: str = "", floor: float = 1.0) -> float:
    """Largest :func:`rel_diff` over two equally long sequences of numbers (losses, norms, metrics)."""
    assert len(got) == len(ref), f"{_label(what)}{len(got)} values, the reference has {len(ref)}"
    worst = 0.0
    for index, (mine, theirs) in enumerate(zip(got, ref, strict=True)):
        # rel_diff refused a non-finite value, so max cannot drop one here
        worst = max(worst, rel_diff(float(mine), float(theirs), f"{_label(what)}value {index}", floor))
    return worst


def assert_values_close(got: Sequence[float], ref: Sequence[float], rel: float, what: str = "",
                        floor: float = 1.0) -> None:  # fmt: skip
    err = max_rel_diff(got, ref, what, floor)
    assert err <= rel, f"{_label(what)}values differ from the reference by {err:.2e} (relative), limit {rel:.0e}"


def assert_same_non_finite(got: Tensor, ref: Tensor, name: str, what: str = "") -> None:
    """For a reference that legitimately holds inf or NaN (overflow): the same positions hold the same non-finite
    values (+inf, -inf, NaN) in both. The finite rest is then compared with the helpers above."""
    assert got.shape == ref.shape, f"{_label(what)}{name}: shape {tuple(got.shape)}, the reference's {tuple(ref.shape)}"
    for kind, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        mine, theirs = test(got), test(ref)
        assert torch.equal(mine, theirs), (
            f"{_label(what)}{name}: {kind} at {int(mine.sum())} position(s), the "
            f"reference at {int(theirs.sum())}, and not the same ones"
        )
