"""The recorder between Lightning's construction hooks and setup: a model built under
``Trainer.init_module(empty_init=True)`` also passes through configure_model's context (Lightning enters both), so an
empty second build keeps the first; two builds that both made tensors are refused with a message naming the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_strategy.core.init.construction_recorder import ConstructionRecorder

CPU = torch.device("cpu")


def test_an_empty_second_build_keeps_the_first() -> None:
    recorder = ConstructionRecorder()
    with recorder.recording_on(CPU):
        model = nn.Linear(3, 2)
    first = recorder.recording
    assert first is not None and first.made_tensors and model.weight.is_meta
    with recorder.recording_on(CPU):
        pass  # configure_model returning early: the model exists
    assert recorder.take() is first


def test_a_second_build_that_makes_tensors_is_refused() -> None:
    recorder = ConstructionRecorder()
    with recorder.recording_on(CPU):
        nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match=r"built on the meta device twice.*return early from configure_model"):
        with recorder.recording_on(CPU):
            nn.Linear(3, 2)


def test_an_empty_first_build_gives_way_to_the_second() -> None:
    recorder = ConstructionRecorder()
    with recorder.recording_on(CPU):
        pass
    with recorder.recording_on(CPU):
        nn.Linear(3, 2)
    recording = recorder.take()
    assert recording is not None and recording.made_tensors
