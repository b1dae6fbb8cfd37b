"""Changes made to a module parameter in place, outside the optimizer, that ZeRO would lose or multiply.

[Note: in-place changes outside the optimizer]
Under DDP a parameter is one tensor per rank: ``with torch.no_grad(): p.mul_(0.5)`` on every rank changes every
replica, and the change stays. Under ZeRO a module parameter is a view of a flat buffer that is not the master copy
everywhere, so the same line can silently do something else:

- stage 3 with gathers through the network (several hosts, offload): the parameter is a gathered temporary
  copy; the change is lost when its unit is released (the master slices still hold the old values);
- stage 3 on one host's CPUs: the parameter lives once per host in shared memory, so a change every rank makes is
  applied once per rank (clamping or copying the same values is harmless, scaling or adding compounds);
- stages 1/2 whose fp32 masters are kept apart from the parameters (bf16/fp16 parameters, offload): the next
  optimizer step overwrites the parameters from the masters, and the change is lost.

(Stages 1/2 in fp32 without offload keep DDP's behaviour: each rank's slice of the parameters *is* its master
shard, so a change every rank makes stays, and no warning is given.)

Each parameter that ``.data`` re-pointed at the flat buffer has its own version counter (see [Note: views into
one flat buffer] in flat_param.py), which only in-place operations through that parameter move: the engine writes
through other views (the gathered buffer, the master pieces, the shard), and autograd never writes parameters. So a
moved counter at the point where the change would be lost (the unit's release; the optimizer step at stages 1/2)
is a user's change, and is named in a warning there. Not seen: changes through ``p.data`` (a tensor with a
counter of its own).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import Tensor

GATHERED = (
    "at stage 3 a gathered parameter is a temporary copy, so the change is lost when its unit is released (the "
    "master slices keep the old values)."
)
HOST_WIDE = (
    "at stage 3 on one host its values live once per host in shared memory, so a change every rank makes is "
    "applied once per rank: clamping or copying in the same values is safe, scaling or adding to it compounds; "
    "under bf16/fp16 the next optimizer step overwrites it."
)
OVERWRITTEN = (
    "the fp32 master weights are kept apart from the parameters here (bf16/fp16 parameters or offload), so the "
    "next optimizer step overwrites the change from them."
)


class InPlaceChangeWarning(UserWarning):
    """A module parameter was changed in place outside the optimizer where ZeRO loses or multiplies the change."""


class InPlaceWatch:
    """The version counters of one FlatParam's module parameters (see [Note: in-place changes outside the
    optimizer])."""

    def __init__(self, names: Sequence[str], params: Sequence[Tensor]) -> None:
        self._watched = list(zip(names, params, strict=True))
        self._versions = [param._version for param in params]

    def forget(self) -> None:
        """Take the current values as the baseline (after a write that is not a user's change)."""
        self._versions = [param._version for _, param in self._watched]

    def check(self, consequence: str) -> None:
        """Warn, naming the parameters changed in place since the last check, with what becomes of the change."""
        changed = [
            name for (name, param), version in zip(self._watched, self._versions, strict=True)
            if param._version != version
        ]
        if not changed:
            return
        self.forget()
        warnings.warn(
            f"ZeRO: {', '.join(changed)} changed in place outside the optimizer; {consequence} Change weights "
            "through the optimizer or a checkpoint load instead.",
            InPlaceChangeWarning,
            stacklevel=3,
        )
