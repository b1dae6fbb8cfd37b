"""Where a ZeRO strategy's ranks sit, as both adapters report it to Lightning: one process per device of
``parallel_devices`` on each of ``num_nodes`` nodes, global rank = node rank × processes per node + local rank.
Lightning's ``ParallelStrategy`` (the Trainer's and Fabric's) leaves these to each strategy, and its own DDP
strategies each repeat them; the Trainer's ZeroStrategy and the ZeroFabricStrategy take them from here. With
``tensor_parallel_size=K`` the ranks also form the mesh ``data_parallel x tensor_parallel`` (see [Note: ZeRO over the
data-parallel dimension of a 2-D mesh] in core/plan/tensor_parallel.py), exposed as ``device_mesh`` exactly as
Lightning's ModelParallelStrategy exposes it, and the data loader's sampler runs over the data-parallel ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only

from zero_strategy.adapter_plumbing.process_group import DeviceMesh, tensor_parallel_mesh
from zero_strategy.config import ZeroConfig


class ProcessPerDevice:
    """Mixin placed before Lightning's ``ParallelStrategy`` in a strategy's bases."""

    _num_nodes: int
    config: ZeroConfig
    _device_mesh: DeviceMesh | None = None
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
        """Over the data-parallel ranks: with ``tensor_parallel_size=K`` ranks ``d*K .. d*K+K-1`` form one
        tensor-parallel group, which sees one batch (ModelParallelStrategy's layout)."""
        size = self.config.tensor_parallel_size
        return {"num_replicas": self.num_nodes * self.num_processes // size, "rank": self.global_rank // size}

    def assign_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size, and ``rank_zero_only`` which
        rank this process is (lightning_utilities' object, which the Trainer's and Fabric's modules re-export)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``data_parallel x tensor_parallel`` mesh (built with the process group)."""
        if self._device_mesh is None:
            raise RuntimeError(
                "ZeRO: no device mesh: there is one with tensor_parallel_size > 1 (ZeroStrategy(stage=..., "
                "tensor_parallel_size=K)), once the processes are launched (in configure_model and later).")
        return self._device_mesh

    def build_device_mesh(self, device_type: str, world_size: int, module: Any) -> None:
        """After the process group: the mesh, when ``tensor_parallel_size`` asks for one, also on ``module`` (a
        LightningModule reads ``self.device_mesh`` in ``configure_model``; None for Fabric). Collective."""
        if self._device_mesh is None:
            self._device_mesh = tensor_parallel_mesh(device_type, world_size, self.config.tensor_parallel_size)
        if module is not None and self._device_mesh is not None:
            module._device_mesh = self._device_mesh  # what LightningModule.device_mesh reads
