"""What loading a checkpoint asks of the engine it loads into: the write protocol's view of a sharded model (see
[Note: the write protocol] in checkpoint/base/writable.py), plus the FlatParams to write into and the two moments
around the writes. ``ZeroEngine`` satisfies it structurally; checkpoint/ never names the engine class."""

from __future__ import annotations

from typing import Protocol

from zero_strategy.checkpoint.base.writable import WritableSource
from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.placement import Placement


class LoadTarget(WritableSource, Protocol):
    """A sharded model whose slices (and optimizer state) a checkpoint overwrites on this rank."""

    @property
    def flat_params(self) -> list[FlatParam]: ...  # every FlatParam, in checkpoint order

    @property
    def placement(self) -> Placement | None: ...  # offload: where the slices live (an NVMe store pages them)

    def before_load(self) -> None:
        """The slices are about to be overwritten outside a step."""
        ...

    def after_load(self) -> None:
        """The slices were overwritten: publish them to the module (a collective at stages 1/2)."""
        ...
