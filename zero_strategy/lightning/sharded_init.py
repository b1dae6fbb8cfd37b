"""Sharded construction and pretrained loading for ZeroStrategy: what Lightning's construction hooks record, and
which files fill which names when the model is sharded (see [Note: sharded construction] in core/materialize.py).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from zero_strategy.checkpoint.pretrained import (
    PendingLoad,
    PretrainedSource,
    forget_pending,
    open_pretrained,
    pending_loads,
)
from zero_strategy.checkpoint.pretrained_keys import alias_groups, expected_shapes, match_keys
from zero_strategy.config import ZeroConfig
from zero_strategy.core.deferred import Recording, record_construction
from zero_strategy.core.materialize import InitialValues, Pretrained, WeightsReader


class ConstructionRecorder:
    """Holds the recording of the model's construction between Lightning's construction hooks and ``setup``."""

    def __init__(self) -> None:
        self.recording: Recording | None = None

    @contextmanager
    def recording_on(self, device: torch.device) -> Generator[None, None, None]:
        """Build on the meta device, recording how (values are replayed unit by unit when the model is sharded)."""
        if self.recording is not None:
            raise RuntimeError(
                "the model is being built on the meta device a second time before it was sharded (both "
                "Trainer.init_module(empty_init=True) and configure_model?): build it in one of the two."
            )
        with record_construction(device=device) as recording:
            yield
        self.recording = recording

    def take(self) -> Recording | None:
        recording, self.recording = self.recording, None
        return recording


@contextmanager
def initial_values(
    module: nn.Module, recording: Recording | None, config: ZeroConfig, device: torch.device
) -> Generator[InitialValues, None, None]:
    """The engine's initial values for ``module``: the recorded construction, then ``config.pretrained`` and
    every ``load_pretrained`` made in ``configure_model`` (files stay open while the engine reads them)."""
    loads: list[tuple[str, PendingLoad]] = []
    if config.pretrained is not None:
        loads.append(("", PendingLoad(config.pretrained, config.pretrained_strict, None)))
    loads += pending_loads(module)
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
