"""FlatParam: a set of parameters stored as one padded flat buffer, of which this rank owns one slice.

[Note: views into one flat buffer]
The module keeps its own ``nn.Parameter`` objects (optimizers, ``state_dict`` keys and user code hold them);
only their ``.data`` is re-pointed at views of the gathered buffer. Freeing parameters at stage 3 resizes the
*storage* of that buffer to zero bytes and gathering resizes it back and fills it, so every view — including the
ones autograd saved for backward, such as ``weight.t()`` — sees the gathered values again without being
re-created. ``.data`` assignment gives each parameter its own version counter, so the in-place all-gather does not
trip autograd's "modified by an inplace operation" check.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import Tensor, nn

from zero_strategy.core.comm.comm import Comm
from zero_strategy.core.comm.streams import CollectiveStreams
from zero_strategy.core.comm.work import Work
from zero_strategy.core.flat import master_writes
from zero_strategy.core.flat.access import mark_owner, unwrap, wrap
from zero_strategy.core.flat.grads import GradientSlices
from zero_strategy.core.flat.in_place_watch import InPlaceWatch
from zero_strategy.core.flat.master import MasterPieces
from zero_strategy.core.flat.param_values import point_at, real_placeholder
from zero_strategy.core.flat.secondary import SecondaryCopy
from zero_strategy.core.flat.storage import FlatStorage
from zero_strategy.core.plan.flat_specs import FlatSpec
from zero_strategy.core.plan.tensor_parallel import is_distributed


class ParamState(Enum):
    """What the module's parameters of this FlatParam hold."""

    SHARDED = auto()  # nothing: only this rank's slice exists here (stage 3 between uses)
    GATHERING = auto()  # a gather into the full buffer is in flight (a prefetch, or stages 1/2 after a step)
    UNSHARDED = auto()  # the full values


@dataclass(frozen=True, slots=True)
class FlatLinks:
    """What a FlatParam exchanges through, chosen by EngineComms (core/comm/engine_comms.py)."""

    rank: int  # this rank's place in the shard group (which slice it owns)
    comm: Comm  # gathers and reductions over the shard group
    secondary: Comm | None = None  # hierarchical stage 3: the node-local group of the secondary copy
    has_replicas: bool = False  # hybrid sharding: reduced slices are averaged over the replicas at the step
    streams: CollectiveStreams | None = None  # offload on a GPU: the copy stream for reduced slices


class FlatParam:
    """One communication unit's parameters of one kind (dtype × the optimizers that step them): a flat buffer and
    this rank's slice.

    Communication plan: one all-gather of the shards to rebuild the full buffer (stage 3 before use; stages 1/2
    after each step), one reduce-scatter of the flattened gradients per reduction. The initial values were
    broadcast from the group's first rank when the engine built it."""

    def __init__(self, spec: FlatSpec, storage: FlatStorage, links: FlatLinks, keeps_full: bool) -> None:
        self.spec = spec
        self.names = [name for name, _ in spec.named_params]
        self.params = [param for _, param in spec.named_params]
        self.storage = storage
        self.comm = links.comm
        self.rank = links.rank
        self.keeps_full = keeps_full
        self.pieces = MasterPieces.carve(spec.layout, self.params, spec.groups_of, storage.shard, links.rank)
        self.grads = GradientSlices(spec, self.params, links.comm, storage, self.pieces, links.has_replicas,
                                    links.streams)
        self.grads.owner = self
        # the engine's answer to reads of p.grad, weakly (see [Note: p.grad as under DDP] in
        # engine/ddp_gradients.py); None: torch's attribute is the answer
        self.grad_reader: weakref.WeakMethod | None = None
        full = storage.full.tensor
        self.secondary = None if keeps_full or links.secondary is None else SecondaryCopy(
            spec.layout.padded_numel, full.dtype, full.device, links.secondary)  # see [Note: hierarchical parameters]
        self.state = ParamState.UNSHARDED
        self._gather: Work | None = None  # in flight while GATHERING
        self._gather_fills_secondary = False  # the gather in flight comes from the world and refreshes `secondary`
        self._private: Tensor | None = None  # host-wide buffer: this rank's copy inside gathered_parameters()
        for span, param in zip(spec.layout.spans, self.params, strict=True):
            view = full[span.offset : span.end].view(span.shape)
            if param.is_meta:  # `.data` of a meta parameter cannot point at real storage: make it real first
                torch.utils.swap_tensors(param, real_placeholder(param, view))
            point_at(param, view)  # its own version counter (see [Note: views into one flat buffer])
            # see [Note: parameters outside forward] in access.py; a tensor-parallel parameter keeps its class (a
            # DTensor's dispatch is its class's): it is read outside forward inside gathered_parameters() only
            if not keeps_full and not is_distributed(param):
                mark_owner(param, span.name, self)
        self.in_place = InPlaceWatch(self.names, self.params)  # see [Note: in-place changes outside the optimizer]

    # ------------------------------------------------------------------------------ what others read
    @property
    def layout(self):  # noqa: ANN201 (FlatLayout; a property so that it reads like the attribute it was)
        return self.spec.layout

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def trainable(self) -> bool:
        return self.spec.trainable

    @property
    def shard(self) -> Tensor:
        """This rank's master slice (fp32 for trainable parameters): the source of truth."""
        return self.storage.shard

    @property
    def full(self) -> Tensor:
        """The gathered buffer (compute dtype); holds no storage while SHARDED at stage 3."""
        return self.storage.full.tensor

    @property
    def master_pieces(self) -> list[nn.Parameter]:
        return self.pieces.pieces

    @property
    def piece_offset(self) -> list[int]:
        return self.pieces.offsets

    @property
    def optimizers(self) -> tuple[int, ...]:
        """The optimizers that step this FlatParam (ascending; empty when none does)."""
        return self.spec.optimizers

    def piece_group_in(self, optimizer: int) -> list[int]:
        """Each master piece's param group in optimizer ``optimizer`` (one of :attr:`optimizers`)."""
        position = self.spec.optimizers.index(optimizer)
        return [groups[position] for groups in self.pieces.groups]

    @property
    def param_groups(self) -> list[tuple[int, ...]]:
        """Each parameter's param group in every optimizer of :attr:`optimizers` (empty tuples when none steps
        it); checkpoints record it."""
        return [self.spec.groups_of.get(id(p), ()) for p in self.params]

    def param_group_in(self, optimizer: int) -> list[int]:
        """Each parameter's param group in optimizer ``optimizer`` (one of :attr:`optimizers`)."""
        return [self.spec.group_in(p, optimizer) for p in self.params]

    @property
    def reduce_bytes(self) -> int:
        return self.spec.reduce_bytes

    def read_grad(self, param: Tensor, torch_value: Tensor | None) -> Tensor | None:
        """What a user's read of ``param.grad`` returns (``torch_value``: torch's attribute)."""
        reader = self.grad_reader() if self.grad_reader is not None else None
        if reader is None:
            return torch_value
        index = next(i for i, candidate in enumerate(self.params) if candidate is param)
        return reader(self, index, torch_value)

    def write_grad(self, param: Tensor, value: Tensor | None) -> bool:
        """A user's ``param.grad = value``: whether the engine took it (False: torch's attribute is the answer)."""
        reader = self.grad_reader() if self.grad_reader is not None else None
        if reader is None:
            return False
        index = next(i for i, candidate in enumerate(self.params) if candidate is param)
        return reader.__self__.write(self, index, value)

    def forget_grad(self, param: Tensor) -> None:
        """``nn.Module.zero_grad()`` cleared ``param``'s gradient: so does the engine."""
        reader = self.grad_reader() if self.grad_reader is not None else None
        if reader is not None:
            index = next(i for i, candidate in enumerate(self.params) if candidate is param)
            reader.__self__.forget(self, index)

    # ----------------------------------------------------------------------------------- shard / unshard
    def start_unshard(self, label: str | None = None) -> None:
        """Start gathering every rank's slice into the full buffer (asynchronously where possible). ``label``: what
        the gather is for, when not the unit's own use (see [Note: parameters outside forward] in access.py)."""
        if self.state is not ParamState.SHARDED:
            return
        full = self.storage.full
        if full.readable_in_place:  # the peers' slices are read where they lie
            self.state = ParamState.UNSHARDED
            unwrap(self.params)
            return
        full.allocate()
        secondary = self.secondary
        if secondary is not None and secondary.fresh:  # hierarchical stage 3: gathered inside the node
            self._gather = secondary.start_gather(full.tensor, label or self.label)
        else:
            self._gather = self.comm.all_gather(full.tensor, self.storage.gather_source(), label or self.label)
            self._gather_fills_secondary = secondary is not None
        self.state = ParamState.GATHERING

    def unshard(self, label: str | None = None) -> None:
        """Make the module's parameters usable: start a gather if none is in flight, and wait for it."""
        if self.state is ParamState.SHARDED:
            self.start_unshard(label)
        if self.state is ParamState.GATHERING:
            self._land_gather()

    def _land_gather(self) -> None:
        assert self._gather is not None, "GATHERING without a gather in flight"
        self._gather.wait()
        self._gather = None
        self.state = ParamState.UNSHARDED
        unwrap(self.params)
        if self._gather_fills_secondary and self.secondary is not None:
            self.secondary.keep_slice_of(self.storage.full.tensor)
        self._gather_fills_secondary = False
        self.storage.after_host_read()

    def reshard(self) -> None:
        """Let go of the full values (stage 3); the module's parameter views keep their shapes but hold no memory.
        A prefetch nobody used lands first."""
        if self.keeps_full:
            raise RuntimeError(f"ZeRO: {self.label}'s parameters are kept whole at this stage; they are never freed")
        if self.state is ParamState.GATHERING:
            self._land_gather()
        if self.state is ParamState.SHARDED:
            return
        private, self._private = self._private, None
        master_writes.take_changes_at_release(self, private)  # see [Note: in-place changes outside the optimizer]
        self.storage.full.free()
        self.state = ParamState.SHARDED
        wrap(self.params)  # see [Note: parameters outside forward] in access.py

    def release_gathered(self) -> None:
        """Free the full values where this FlatParam does not keep them (stage 3); stages 1/2 always keep them."""
        if not self.keeps_full:
            self.reshard()

    def start_publish(self) -> Work:
        """The slice changed (an optimizer step, a load): make the module see the new values. Stage 3 drops any
        gathered copy (the next forward gathers the new values); stages 1/2 start re-gathering the full buffer.
        Returns the Work to wait for."""
        if not self.keeps_full:
            self.storage.write_own_slice()
            self.reshard()
            if self.secondary is not None:
                self.secondary.mark_stale()
            return Work.done()
        if self.state is ParamState.GATHERING:
            self._land_gather()
        source = self.storage.shard if self.storage.shard_aliases_full else self.storage.gather_source()
        self._gather = self.comm.all_gather(self.storage.full.tensor, source, self.label)
        self.state = ParamState.GATHERING
        return Work(self._finish_publish)

    def _finish_publish(self) -> Tensor:
        if self.state is ParamState.GATHERING:
            self._land_gather()
        return self.storage.full.tensor

    @contextmanager
    def gathered(self, label: str | None = None) -> Iterator[None]:
        """The full values for the duration of the block, then the state before it (a collective at stage 3 on the
        network path; ``label`` names the gather for the divergence watch when it is not the unit's own use)."""
        was_sharded = self.state is ParamState.SHARDED
        self.unshard(label)
        try:
            yield
        finally:
            if was_sharded:
                self.reshard()

    def settle(self) -> None:
        """Let a gather in flight land, and give the parameters their own class (the engine lets the module go)."""
        if self.state is ParamState.GATHERING:
            self._land_gather()
        unwrap(self.params)

    def land_prefetch(self) -> None:
        """A gather in flight (a prefetch) lands now; the parameters take their own class."""
        if self.state is ParamState.GATHERING:
            self._land_gather()

    def write_whole(self, whole: Tensor, label: str) -> None:
        """See master_writes.write_whole (a collective)."""
        master_writes.write_whole(self, whole, label, in_use=self.state is ParamState.UNSHARDED)
        if self._private is not None:  # inside gathered_parameters() on one host: the module reads this copy
            with torch.no_grad():
                self._private.copy_(whole)

    def take_in_place_changes(self) -> list[str]:
        """Stages 1/2 with masters apart from the parameters: the parameters changed in place since the last step
        take this rank's ranges into its master slice before the step (see master_writes.take_changes). Local."""
        return master_writes.take_changes(self, self.storage.full.tensor)

    def unshard_private(self) -> None:
        """``gathered_parameters()``: the full values where a change made in place stays this rank's own until the
        release takes it into the masters (see [Note: in-place changes outside the optimizer]). A private gathered
        buffer is that already; a host-wide one is copied, so that a change every rank makes lands once per rank."""
        if not (self.storage.full.readable_in_place and self.state is ParamState.SHARDED):
            self.unshard()
            return
        unwrap(self.params)
        self._private = master_writes.private_copy(self)
        self.state = ParamState.UNSHARDED

    # ------------------------------------------------------------------------------------ initial values
    def write_initial_value(self, index: int, value: Tensor) -> None:
        """Sharded construction: parameter ``index``'s whole initial value. This rank keeps its part of the slice,
        and at stages 1/2 the full value (every rank replays the same values, so nothing is gathered)."""
        flat_value = value.detach().reshape(-1)
        span = self.spec.layout.spans[index]
        with torch.no_grad():
            if self.keeps_full:
                self.storage.full.tensor[span.offset : span.end].copy_(flat_value)
            if not (self.keeps_full and self.storage.shard_aliases_full):  # else written into the buffer just now
                start, end = self.storage.own_range
                lo, hi = max(span.offset, start), min(span.end, end)
                if lo < hi:
                    self.storage.shard[lo - start : hi - start].copy_(flat_value[lo - span.offset : hi - span.offset])

    def write_shard_range(self, index: int, param_start: int, values: Tensor) -> None:
        """Elements ``[param_start, param_start + len(values))`` of parameter ``index``, which must lie in this
        rank's slice, into the slice (pretrained loading and checkpoints; publish afterwards)."""
        span = self.spec.layout.spans[index]
        offset = span.offset + param_start - self.storage.own_range[0]
        with torch.no_grad():
            self.storage.shard[offset : offset + values.numel()].copy_(values)

    def own_shard(self) -> None:
        """Give the slice memory of its own, and the master pieces (the optimizer's parameters) views of it: nothing
        keeps the gathered buffer (for stage 3 on one host, a host-wide buffer) alive once it is dropped."""
        self.pieces.repoint(self.storage.own_shard())
