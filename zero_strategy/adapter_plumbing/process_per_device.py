"""Where a ZeRO strategy's ranks sit, as both adapters report it to Lightning: one process per device of
``parallel_devices`` on each of ``num_nodes`` nodes, global rank = node rank × processes per node + local rank.
Lightning's ``ParallelStrategy`` (the Trainer's and Fabric's) leaves these to each strategy, and its own DDP
strategies each repeat them; the Trainer's ZeroStrategy and the ZeroFabricStrategy take them from here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only


class ProcessPerDevice:
    """Mixin placed before Lightning's ``ParallelStrategy`` in a strategy's bases."""

    _num_nodes: int
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None

    if TYPE_CHECKING:  # given by ParallelStrategy

        @property
        def local_rank(self) -> int: ...

        @property
        def node_rank(self) -> int: ...

        @property
        def global_rank(self) -> int: ...

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def assign_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size, and ``rank_zero_only`` which
        rank this process is (lightning_utilities' object, which the Trainer's and Fabric's modules re-export)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
