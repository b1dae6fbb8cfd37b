"""What a checkpoint writer reads from a sharded source: the write protocol of checkpoint/.

[Note: the write protocol]
The writers (``checkpoint/sharded/save.py``, ``checkpoint/dcp/save.py``) never name the engine: they read a
:class:`WritableSource`, which a running ``ZeroEngine`` satisfies as it is (structurally, nothing to inherit) and
which ``ModuleSnapshot`` (``checkpoint/sharded/module_snapshot.py``) implements for a module no engine holds. A
source is this rank's view of a sharded model: its place among the ranks and the Comms to agree with the others,
its FlatParams in checkpoint order (each with this rank's slice, the flat layout mapping the slice onto parameters,
and the optimizer pieces carved from the slice), the names under which parameters are stored, the module (for the
state-dict keys and the buffers), the optimizers (for their state and hyper-parameters) and the ZeRO stage the
manifest records. mypy holds both implementations to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from torch import Tensor, nn
from torch.optim import Optimizer

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.engine_comms import ReplicaComm
from zero_strategy.core.stage import ZeroStage


class RankPosition(Protocol):
    """Where this rank sits: which slice of every FlatParam it owns, and which shard group it belongs to."""

    @property
    def rank(self) -> int: ...  # position in the shard group

    @property
    def world_size(self) -> int: ...  # ranks of the shard group

    @property
    def replica_index(self) -> int: ...  # hybrid sharding: which shard group (0 writes the shards)


class WriterComms(Protocol):
    """The Comms a save agrees over: every rank of the run, (hybrid sharding) this rank's replicas, and (tensor
    parallelism: ``everyone`` is then the data-parallel group) this rank's tensor-parallel group."""

    @property
    def everyone(self) -> Comm: ...

    @property
    def replicas(self) -> ReplicaComm | None: ...

    @property
    def tensor(self) -> Comm | None: ...


class WritableFlat(Protocol):
    """One FlatParam as a writer reads it."""

    @property
    def names(self) -> list[str]: ...  # its parameters' canonical names, in layout order

    @property
    def shard(self) -> Tensor: ...  # 1-D: this rank's slice of the padded flat buffer

    @property
    def layout(self) -> Any: ...  # FlatLayout: the parameters' spans and each rank's overlaps with them

    @property
    def param_groups(self) -> list[tuple[int, ...]]: ...  # per parameter: its group in each optimizer stepping it

    @property
    def master_pieces(self) -> list[nn.Parameter]: ...  # this rank's optimizer pieces (the state's keys)

    @property
    def piece_offset(self) -> list[int]: ...  # where each piece starts in the slice

    def piece_group_in(self, optimizer: int) -> list[int]: ...  # per piece: its group in optimizer ``optimizer``

    def param_group_in(self, optimizer: int) -> list[int]: ...  # per parameter: its group in ``optimizer``


class WritableSource(Protocol):
    """A sharded model, as a checkpoint writer reads it on one rank (see [Note: the write protocol])."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def optimizers(self) -> Sequence[Optimizer]: ...

    @property
    def stage(self) -> ZeroStage: ...

    @property
    def place(self) -> RankPosition: ...

    @property
    def comms(self) -> WriterComms: ...

    def named_flat_params(self) -> Iterator[tuple[str, WritableFlat, tuple[int, ...]]]:
        """(stable key, FlatParam, the optimizers that step it), in checkpoint order."""
        ...

    def parameter_names(self) -> dict[int, str]:
        """``id(param)`` → the canonical name under which the checkpoint stores it."""
        ...
