"""Before an optimizer step, the changes made in place to the module's parameters reach the master slices where the
masters are kept apart from the parameters (stages 1/2 under bf16/fp16 or offload); see [Note: in-place changes
outside the optimizer] in core/flat/in_place_watch.py."""

from __future__ import annotations

from collections.abc import Iterable

from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.in_place_watch import warn_rounded


def take_in_place_changes(flats: Iterable[FlatParam]) -> None:
    """Each FlatParam kept whole whose parameters are not its masters takes its changed parameters' ranges into
    its masters (local: every rank changed its whole copy alike). In fp32 (offload) that is exact; in bf16/fp16
    the masters get the change as the parameters hold it, rounded to their dtype, and a warning says so."""
    rounded: list[str] = []
    for flat in flats:
        if not flat.keeps_full or flat.storage.shard_aliases_full:  # stage 3 changes its masters itself
            continue
        names = flat.take_in_place_changes()
        if names and flat.full.dtype != flat.shard.dtype:
            rounded += names
    if rounded:
        warn_rounded(rounded)
