"""DeepSpeed's dynamic loss-scaling rule, checked sequence by sequence."""

from __future__ import annotations

import pytest

from zero_strategy.core.engine.loss_scaler import DynamicLossScaler, LossScalerConfig


def scales_after(pattern: list[int], **knobs: object) -> list[float]:
    scaler = DynamicLossScaler(LossScalerConfig(**knobs))  # type: ignore[arg-type]
    out = []
    for overflow in pattern:
        scaler.update(bool(overflow))
        out.append(scaler.scale)
    return out


def test_issue_example_three_overflows() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=16, hysteresis=2))
    seen = []
    for _ in range(3):
        scaler.update(True)
        seen.append(scaler.scale)
    assert seen == [65536.0, 32768.0, 16384.0]
    assert scaler.skipped_steps == 3


def test_growth_after_window_counts_from_last_overflow() -> None:
    # window 3: the first growth comes when (iteration - last_overflow) % 3 == 0, with last_overflow = -1 at start
    assert scales_after([0, 0, 0, 0, 0, 0], initial_scale_power=2, loss_scale_window=3) == [4, 4, 8, 8, 8, 16]
    # an overflow (hysteresis 2: absorbed) restarts the window
    seq = scales_after([0, 1, 0, 0, 0], initial_scale_power=2, loss_scale_window=3, hysteresis=2)
    assert seq == [4, 4, 4, 4, 8]


def test_hysteresis_refills_only_at_growth_by_default() -> None:
    # overflow, clean, overflow: the counter (2 -> 1) was not refilled by the clean step, so the 2nd halves
    assert scales_after([1, 0, 1], initial_scale_power=4, hysteresis=2, loss_scale_window=100) == [16, 16, 8]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    knobs = {"initial_scale_power": 4, "hysteresis": 2, "loss_scale_window": 100, "consecutive_hysteresis": True}
    seq = scales_after([1, 0, 1], **knobs)
    assert seq == [16, 16, 16]


def test_scale_never_below_minimum_and_minimum_overflow_is_fatal() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0))
    scaler.update(True)
    assert scaler.scale == 2.0
    assert scaler.would_fail(True)
    assert not scaler.would_fail(False)


def test_static_scale_never_moves_but_counts_skips() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(loss_scale=128.0))
    for overflow in (True, False, True):
        scaler.update(overflow)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 2


def test_state_dict_round_trip() -> None:
    scaler = DynamicLossScaler(LossScalerConfig(initial_scale_power=5))
    for overflow in (True, True, False):
        scaler.update(overflow)
    restored = DynamicLossScaler(LossScalerConfig(initial_scale_power=5))
    restored.load_state_dict(scaler.state_dict())
    for overflow in (False, True, False):
        scaler.update(overflow)
        restored.update(overflow)
    assert (restored.scale, restored.skipped_steps, restored.hysteresis_left) == (
        scaler.scale,
        scaler.skipped_steps,
        scaler.hysteresis_left,
    )


@pytest.mark.parametrize(
    ("knobs", "word"),
    [
        ({"loss_scale_window": 0}, "loss_scale_window"),
        ({"min_loss_scale": 2.0**20, "initial_scale_power": 16}, "min_loss_scale"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"loss_scale": -1.0}, "loss_scale"),
    ],
)
def test_bad_knobs_are_named(knobs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        LossScalerConfig(**knobs)
