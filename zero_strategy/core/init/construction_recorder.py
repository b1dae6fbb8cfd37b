"""The recording of a model's construction, kept between the construction hooks (the Trainer's ``configure_model``
/ ``init_module(empty_init=True)``, Fabric's ``init_module``) and the engine that replays it when the model is
sharded (see [Note: sharded construction] in core/init/materialize.py). Both adapters hold one."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import nn

from zero_strategy.core.init import Recording, materialize_module, record_construction
from zero_strategy.core.init.capture import continue_recording
from zero_strategy.core.init.materialize import meta_names


class ConstructionRecorder:
    """Holds the recording of the model's construction between Lightning's construction hooks and ``setup``."""

    def __init__(self) -> None:
        self.recording: Recording | None = None

    @contextmanager
    def recording_on(self, device: torch.device) -> Generator[None, None, None]:
        """Build on the meta device, recording how (values are replayed unit by unit when the model is sharded)."""
        if self.recording is not None and self.recording.made_tensors:
            with self._continued(self.recording):
                yield
            return
        with record_construction(device=device) as recording:
            yield
        # A model built under Trainer.init_module(empty_init=True) meets configure_model's context too, and
        # Lightning asks configure_model to return early when the model exists: that build is continued above. An
        # empty first recording (configure_model building nothing) gives way to the next.
        if self.recording is None or recording.made_tensors:
            self.recording = recording

    @contextmanager
    def _continued(self, recording: Recording) -> Generator[None, None, None]:
        """configure_model after a build under Trainer.init_module(empty_init=True): what it does to the meta model
        is recorded as following the build, so that a tensor-parallel plan applied there (parallelize_module)
        finds the parameters it distributes (see [Note: tensor-parallel parameters built on the meta device] in
        core/init/distributed_origins.py). A second build without a plan is refused, as two separate
        recordings were before."""
        storages, distributed = len(recording.storage_nbytes), len(recording.distributed)
        with continue_recording(recording, "configure_model()"):
            yield
        if len(recording.storage_nbytes) > storages and len(recording.distributed) == distributed:
            # Two builds cannot be told apart from one construction: the module keeps the second's tensors.
            raise RuntimeError(
                "the model was built on the meta device twice before it was sharded (under "
                "init_module(empty_init=True) and again in configure_model): build it in one of the two, "
                "e.g. return early from configure_model when the model exists."
            )

    def take(self) -> Recording | None:
        recording, self.recording = self.recording, None
        return recording

    def materialize_if_nothing_to_shard(self, module: nn.Module) -> None:
        """A build that made no parameter or buffer on the meta device (the network came from ``__init__``), only
        other tensors (metrics built in ``configure_model``), has nothing to shard: those tensors get their values
        now, on this rank, as an eager build on this rank gives them (see [Note: attribute tensors] in
        core/init/attribute_tensors.py), before Lightning moves the module to its device."""
        recording = self.recording
        if recording is not None and recording.made_tensors and not meta_names(module):
            self.recording = None
            materialize_module(module, recording)
