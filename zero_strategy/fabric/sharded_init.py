"""Sharded construction and pretrained loading, shared by both adapters (the Trainer's imports it from here): what
the construction hooks record, and which files fill which names when the model is sharded (see [Note: sharded
construction] in core/init/materialize.py and [Note: the reset_parameters contract] in core/init/resets.py)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from dataclasses import replace

import torch
from torch import nn

from zero_strategy.checkpoint.pretrained.keys import alias_groups, expected_shapes, match_keys
from zero_strategy.checkpoint.pretrained.open import (
    PendingLoad,
    PretrainedSource,
    forget_pending,
    open_pretrained,
    pending_loads,
)
from zero_strategy.config import MetaInit, ZeroConfig
from zero_strategy.core.init import Recording, materialize_module, record_construction, record_resets
from zero_strategy.core.init.materialize import InitialValues, Pretrained, WeightsReader, meta_names
from zero_strategy.core.step.engine import ZeroEngine
from zero_strategy.core.step.release import ReleasedShards


class ConstructionRecorder:
    """Holds the recording of the model's construction between Lightning's construction hooks and ``setup``."""

    def __init__(self) -> None:
        self.recording: Recording | None = None

    @contextmanager
    def recording_on(self, device: torch.device) -> Generator[None, None, None]:
        """Build on the meta device, recording how (values are replayed unit by unit when the model is sharded)."""
        with record_construction(device=device) as recording:
            yield
        # A model built under Trainer.init_module(empty_init=True) meets configure_model's context too, and
        # Lightning asks configure_model to return early when the model exists: an empty second recording keeps
        # the first. Two recordings that both built tensors cannot be replayed as one construction.
        if self.recording is None or not recording.made_tensors:
            self.recording = self.recording or recording
            return
        if self.recording.made_tensors:
            raise RuntimeError(
                "the model was built on the meta device twice before it was sharded (under "
                "init_module(empty_init=True) and again in configure_model): build it in one of the two, "
                "e.g. return early from configure_model when the model exists."
            )
        self.recording = recording

    def take(self) -> Recording | None:
        recording, self.recording = self.recording, None
        return recording

    def materialize_if_nothing_to_shard(self, module: nn.Module) -> None:
        """A build that made no parameter or buffer on the meta device (the network came from ``__init__``), only
        other tensors (metrics built in ``configure_model``), has nothing to shard: those tensors get their values
        now, on this rank, as an eager build on this rank gives them (see [Note: held tensors] in
        core/init/held.py), before Lightning moves the module to its device."""
        recording = self.recording
        if recording is not None and recording.made_tensors and not meta_names(module):
            self.recording = None
            materialize_module(module, recording)


@contextmanager
def initial_values(
    module: nn.Module, recording: Recording | None, config: ZeroConfig, device: torch.device
) -> Generator[InitialValues, None, None]:
    """The engine's initial values for ``module``: the recorded construction (followed by every module's
    ``reset_parameters()`` with ``meta_init="reset_parameters"``), then ``config.pretrained`` and every
    ``load_pretrained`` made in ``configure_model`` (files stay open while the engine reads them)."""
    loads: list[tuple[str, PendingLoad]] = []
    if config.pretrained is not None:
        loads.append(("", PendingLoad(config.pretrained, config.pretrained_strict, None)))
    loads += pending_loads(module)
    if recording is not None and recording.made_tensors and config.meta_init is MetaInit.reset_parameters:
        record_resets(module, recording)  # see [Note: the reset_parameters contract]
    with ExitStack() as files:
        plan: dict[str, tuple[WeightsReader, str]] = {}
        for prefix, load in loads:
            target = module.get_submodule(prefix) if prefix else module
            source: PretrainedSource = files.enter_context(open_pretrained(load.path, load.key_map))
            match = match_keys(source, expected_shapes(target), load.strict, alias_groups(target), str(source.path))
            for name, source_name in match.plan.items():
                plan[f"{prefix}.{name}" if prefix else name] = (source, source_name)
        forget_pending(module)
        yield InitialValues(recording, Pretrained(plan) if plan else None, device)


def take_back_released(
    values: InitialValues, module: nn.Module, released: ZeroEngine | None, device: torch.device
) -> InitialValues:
    """A module whose parameters a previous engine left sharded (fit, then test on the same Trainer) gets them
    back from that engine's slices, each rank reading its own (see [Note: releasing a model built sharded] in
    core/release.py). Weights named by ``values.pretrained`` still win; a recording that built no tensor (the
    model existed, ``configure_model`` returned early, perhaps after reseeding) is dropped."""
    if released is None:
        return values
    plan: dict[str, tuple[WeightsReader, str]] = dict(
        ReleasedShards(released.flat_params).plan_for(module)
    )
    if not plan:
        return values
    recording = values.recording if values.recording is not None and values.recording.made_tensors else None
    if values.pretrained is not None:
        plan.update(values.pretrained.plan)
    return replace(values, recording=recording, pretrained=Pretrained(plan), device=values.device or device)
