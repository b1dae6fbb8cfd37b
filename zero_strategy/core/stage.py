"""The ZeRO stage and the two decisions it makes — defined here and read nowhere else."""

from __future__ import annotations

from enum import IntEnum


class ZeroStage(IntEnum):
    """Which model states are sharded across data-parallel ranks.

    Every stage shares the same machinery (flat padded units, an fp32 master slice per rank, an optimizer that
    sees only slices); the stage changes exactly the two properties below.
    """

    OPTIMIZER_STATES = 1
    GRADIENTS = 2
    PARAMETERS = 3

    @property
    def reduces_every_microstep(self) -> bool:
        """Whether gradients are reduce-scattered as each backward completes (and the full gradients freed).

        Stage 1 keeps full gradients through accumulation and communicates only at the optimizer step.
        """
        return self >= ZeroStage.GRADIENTS

    @property
    def reshards_parameters(self) -> bool:
        """Whether full parameters are freed outside forward/backward and all-gathered on demand."""
        return self >= ZeroStage.PARAMETERS
