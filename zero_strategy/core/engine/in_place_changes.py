"""Before an optimizer step, the changes made in place to the module's parameters reach the master slices where the
masters are kept apart from the parameters (stages 1/2 under bf16/fp16 or offload); see [Note: in-place changes
outside the optimizer] in core/flat/in_place_watch.py."""

from __future__ import annotations

from collections.abc import Iterable

from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.in_place_watch import refuse_rounded


def take_in_place_changes(flats: Iterable[FlatParam]) -> None:
    """Each FlatParam kept whole whose parameters are not its masters takes its changed parameters' ranges into
    its masters (local: every rank changed its whole copy alike). In fp32 (offload) that is exact. In bf16/fp16 the
    changes made where the watch sees them were applied to the masters already (core/flat/exact_writes.py); one
    found here was made where nothing saw it, and would reach the masters rounded: refused before any master is
    written, naming the parameters."""
    flats = list(flats)
    rounded = [flat.names[index] for flat in flats if _apart(flat) and flat.full.dtype != flat.shard.dtype
               for index in flat.in_place.changed()]
    if rounded:
        refuse_rounded(rounded)
    for flat in flats:
        if _apart(flat):
            flat.take_in_place_changes()


def _apart(flat: FlatParam) -> bool:
    """Whether ``flat``'s masters are kept apart from its whole parameters (stage 3 changes its masters itself)."""
    return flat.keeps_full and not flat.storage.shard_aliases_full
