"""An engine's initial values, shared by both adapters: the recorded construction, then which files fill which
names when the model is sharded (pretrained files, or the slices an earlier engine left: see [Note: sharded
construction] in core/init/materialize.py and [Note: the reset_parameters contract] in core/init/resets.py). It
reads the checkpoint room's pretrained readers, so it sits above core/ and checkpoint/; no Lightning."""

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
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.release import ReleasedShards
from zero_strategy.core.init import Recording, record_resets
from zero_strategy.core.init.materialize import InitialValues, Pretrained, WeightsReader


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
        sources: dict[str, tuple[WeightsReader, str]] = {}
        for prefix, load in loads:
            target = module.get_submodule(prefix) if prefix else module
            source: PretrainedSource = files.enter_context(open_pretrained(load.path, load.key_map))
            match = match_keys(source, expected_shapes(target), load.strict, alias_groups(target), str(source.path))
            for name, source_name in match.sources.items():
                sources[f"{prefix}.{name}" if prefix else name] = (source, source_name)
        forget_pending(module)
        yield InitialValues(recording, Pretrained(sources) if sources else None, device)


def take_back_released(
    values: InitialValues, module: nn.Module, released: ZeroEngine | None, device: torch.device
) -> InitialValues:
    """A module whose parameters a previous engine left sharded (fit, then test on the same Trainer) gets them
    back from that engine's slices, each rank reading its own (see [Note: releasing a model built sharded] in
    core/engine/release.py). Weights named by ``values.pretrained`` still win; a recording that built no tensor (the
    model existed, ``configure_model`` returned early, perhaps after reseeding) is dropped."""
    if released is None:
        return values
    sources: dict[str, tuple[WeightsReader, str]] = dict(
        ReleasedShards(released.flat_params).plan_for(module)
    )
    if not sources:
        return values
    recording = values.recording if values.recording is not None and values.recording.made_tensors else None
    if values.pretrained is not None:
        sources.update(values.pretrained.sources)
    return replace(values, recording=recording, pretrained=Pretrained(sources), device=values.device or device)
