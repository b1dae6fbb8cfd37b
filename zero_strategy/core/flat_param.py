"""FlatParam: a set of parameters stored as one padded flat buffer, of which this rank owns one slice.

[Note: views into one flat buffer]
The module keeps its own ``nn.Parameter`` objects (optimizers, ``state_dict`` keys and user code hold them);
only their ``.data`` is re-pointed at views of ``full``. Freeing parameters at stage 3 resizes the *storage* of
``full`` to zero bytes and gathering resizes it back and fills it, so every view — including the ones autograd
saved for backward, such as ``weight.t()`` — sees the gathered values again without being re-created. ``.data``
assignment gives each parameter its own version counter, so the in-place all-gather does not trip autograd's
"modified by an inplace operation" check.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import Tensor, nn

from zero_strategy.config import OffloadDevice
from zero_strategy.core.flat_grads import flatten_grads
from zero_strategy.core.hierarchical import SecondaryCopy
from zero_strategy.core.in_place_watch import GATHERED, HOST_WIDE, InPlaceWatch
from zero_strategy.core.layout import FlatLayout, group_ranges
from zero_strategy.core.offload import Placement
from zero_strategy.core.transport.choice import DistContext
from zero_strategy.core.transport.collectives import (
    CommunicationLog,
    PendingGather,
    PendingReduce,
    all_gather_flat,
    broadcast_flat,
    start_reduce_scatter_mean,
)
from zero_strategy.core.transport.gather_watch import GatherWatch
from zero_strategy.core.transport.shared_exchange import SharedExchange, SharedExchangeOp
from zero_strategy.core.transport.shared_shards import NodeSharedBuffer, SharedShards
from zero_strategy.core.transport.streams import CollectiveStreams, copy_host_to_device, host_to_device


class ShardState(Enum):
    """Whether ``full`` holds the gathered parameters (UNSHARDED) or no storage at all (SHARDED)."""

    SHARDED = auto()
    UNSHARDED = auto()


@dataclass(frozen=True, slots=True)
class FlatOptions:
    """How a FlatParam stores its buffers."""

    keeps_full: bool  # stages 1/2: `full` is never freed
    compute_dtype: torch.dtype | None = None  # dtype of `full` (what forward sees); None: the parameters' own
    placement: Placement | None = None  # offload: where the shard lives; None: next to `full`
    shared: SharedShards | None = None  # stage 3, one host's CPU ranks: `full` once per host in shared memory
    reduce_dtype: torch.dtype | None = None  # gradients are reduced in this dtype; None: the compute dtype
    materialize_device: torch.device | None = None  # meta parameters: where their storage is made
    streams: CollectiveStreams | None = None  # CUDA side streams (see [Note: streams for gathers and reductions])


class FlatParam:
    """One communication unit's parameters of one kind (dtype × optimizer): a flat buffer and this rank's slice.

    Communication plan: one broadcast at construction (rank 0's initial values); one reduce-scatter of the
    flattened gradients per reduction; one all-gather of the shards to rebuild ``full``.
    """

    full: Tensor  # 1-D, compute dtype, padded_numel elements; storage resized to 0 bytes while SHARDED
    shard: Tensor  # 1-D, this rank's slice: the source of truth (fp32 for trainable parameters)
    master_pieces: list[nn.Parameter]  # views of `shard`, one per optimizer param group it touches
    piece_group_index: list[int]  # for each master piece, the index of its optimizer param group
    piece_offset: list[int]  # for each master piece, where it starts inside `shard`
    label: str = ""  # the unit this FlatParam belongs to, for messages
    watch: GatherWatch | None = None  # stage 3, network gathers: see [Note: diverging gathers]
    exchange: SharedExchange | None = None  # one host's CPU ranks: see [Note: shared-memory reductions]
    secondary: SecondaryCopy | None  # hierarchical stage 3: this rank's 1/K of `full`, see core/hierarchical.py

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        group_index_of: dict[int, int] | None,
        ctx: DistContext,
        log: CommunicationLog,
        options: FlatOptions,
    ) -> None:
        """``group_index_of`` maps ``id(param)`` to its optimizer param group; None for parameters no optimizer
        updates (frozen, or evaluation without an optimizer)."""
        self.names = [name for name, _ in named_params]
        self._salt = zlib.crc32(self.names[0].encode())  # the same on every rank, differs between units
        self.params = [param for _, param in named_params]
        self.ctx = ctx
        self.log = log
        self.trainable = group_index_of is not None
        # each parameter's optimizer param group (None: no optimizer steps it); checkpoints record it
        self.param_group_index = [group_index_of[id(p)] if group_index_of else None for p in self.params]
        self.layout = FlatLayout.build([(n, tuple(p.shape)) for n, p in named_params], ctx.world_size)
        self.state = ShardState.UNSHARDED
        self._pending: PendingGather | None = None
        self._pending_reduce: PendingReduce | SharedExchangeOp | None = None
        self.grad_stash: Tensor | None = None  # stage 1 + low precision: fp32 full gradients between steps
        self.grad_seen = [False] * len(self.params)  # which parameters produced a gradient since the last step
        self.reduce_dtype = options.reduce_dtype
        self.replica_average_pending = False  # hybrid sharding: reduced slices not yet averaged over the replicas
        self.keeps_full = options.keeps_full
        self._streams = options.streams
        # offload on a GPU: reduced slices on their way to pinned host buffers, and the event after which they are
        # there (see [Note: streams for gathers and reductions])
        self._host_grads: list[tuple[nn.Parameter, int, Tensor]] = []
        self._host_grads_keep: list[Tensor] = []  # the device slices those copies read
        self._host_grads_ready: object | None = None
        self._build_buffers(options)
        self.master_pieces, self.piece_group_index, self.piece_offset = self._carve_master_pieces(
            group_index_of or {}
        )

    # ----------------------------------------------------------------------------------------------- setup
    def _build_buffers(self, options: FlatOptions) -> None:
        first = self.params[0]
        compute_dtype = options.compute_dtype or first.dtype
        deferred = first.is_meta  # see [Note: sharded construction] in materialize.py
        device = (options.materialize_device or torch.device("cpu")) if deferred else first.device
        with torch.no_grad():
            # Built in the parameters' own dtype (fp32): the shard keeps full precision (the master weights).
            if deferred:  # values arrive later (write_initial_value): stage 3 never holds this unit whole here
                full = torch.zeros(self.layout.padded_numel if options.keeps_full else 0, dtype=first.dtype,
                                   device=device)  # fmt: skip
            else:
                full = torch.zeros(self.layout.padded_numel, dtype=first.dtype, device=device)
                for span, param in zip(self.layout.spans, self.params, strict=True):
                    full[span.offset : span.end].copy_(param.detach().reshape(-1))
                broadcast_flat(full, self.ctx.src_rank, self.ctx.group, self.log)
            start, end = self.layout.shard_range(self.ctx.rank)
            # The shard may alias its own segment of `full` when `full` is never freed (stages 1/2) and has the
            # same dtype: that saves a copy of 1/N of the model. Otherwise the shard owns its memory.
            placement = options.placement
            self.placement = placement
            self.shard_aliases_full = options.keeps_full and compute_dtype == first.dtype and placement is None
            self._node: NodeSharedBuffer | None = None  # stage 3, one host: `full` once per host (shared memory)
            initial = full[start:end] if full.numel() else torch.zeros(end - start, dtype=first.dtype, device=device)
            if placement is not None:  # offloaded: the shard lives in host memory or a file
                self.shard = placement.shard_buffer(f"shard-{id(self)}", end - start, first.dtype)
                self.shard.copy_(initial)
            elif options.shared is not None and not options.keeps_full:  # see [Note: shared-memory gathers]
                self._node = options.shared.allocate_full(self.layout.padded_numel, compute_dtype, (start, end))
                (own := self._node.values[start:end]).copy_(initial)
                # fp32: our slice of the node's buffer is the master shard; else the masters stay private
                self.shard_aliases_full = compute_dtype == first.dtype
                self.shard = own if self.shard_aliases_full else initial.clone()
            else:
                self.shard = initial if self.shard_aliases_full or not full.numel() else initial.clone()
            if not full.numel():  # deferred stage 3: the views need a buffer of the full size; its pages are never
                # touched (torch.empty), and its storage is freed as soon as the views exist (below)
                full = torch.empty(self.layout.padded_numel, dtype=compute_dtype, device=device)
            elif compute_dtype != first.dtype:
                full = full.to(compute_dtype)
            if self._node is not None:
                full = self._node.values
        self.full = full
        param_group = self.ctx.param_group
        self.secondary = None if options.keeps_full or param_group is None else SecondaryCopy(
            self.layout.padded_numel, full.dtype, full.device, param_group)  # see [Note: hierarchical parameters]
        self._fills_secondary = False  # the gather in flight comes from the world and refreshes `secondary`
        # Offloaded masters but parameters kept on a GPU: a compute-dtype copy of the shard waits on the device, so
        # a gather needs no host-to-device copy (refreshed after every step).
        self._device_source: Tensor | None = None
        # [Note: gradient slices in files]
        # With nvme optimizer offload the reduced gradient slices (4Ψ/N bytes, the largest thing left in host
        # memory) go to a file of their own, reused every step: after each unit's reduction its pages are released,
        # and the chunked optimizer step maps them back chunk by chunk, like the masters and the optimizer state.
        self._grad_file: Tensor | None = None
        if placement is not None and placement.store is not None and placement.optimizer is OffloadDevice.nvme:
            self._grad_file = placement.shard_buffer(f"grad-{id(self)}", self.shard.numel(), self.shard.dtype)
        if (
            placement is not None
            and not options.keeps_full  # stages 1/2 gather into `full`, which stays on the device anyway
            and placement.keeps_device_gather_source
            and self.shard.device != full.device
        ):
            self._device_source = self.shard.to(device=full.device, dtype=full.dtype)
        for span, param in zip(self.layout.spans, self.params, strict=True):
            view = full[span.offset : span.end].view(span.shape)
            if param.is_meta:  # `.data` of a meta parameter cannot point at real storage: make it real first
                placeholder = torch.empty(0, dtype=view.dtype, device=view.device)
                torch.utils.swap_tensors(param, nn.Parameter(placeholder, requires_grad=param.requires_grad))
            param.data = view  # its own version counter (see [Note: views into one flat buffer])
        self.in_place = InPlaceWatch(self.names, self.params)  # see [Note: in-place changes outside the optimizer]
        if deferred and not options.keeps_full:
            self.reshard()

    def leave_shared_memory(self) -> None:
        """Shared memory failed on some rank (at set-up): our slice goes to private memory, gathers to the network."""
        if self._node is None:
            return
        if self.shard_aliases_full:
            self.shard = self.shard.clone()
            for piece, offset in zip(self.master_pieces, self.piece_offset, strict=True):
                piece.data = self.shard[offset : offset + piece.numel()]
        self.shard_aliases_full, self._node = False, None
        self.full = torch.empty(self.layout.padded_numel, dtype=self.full.dtype)
        for span, param in zip(self.layout.spans, self.params, strict=True):
            param.data = self.full[span.offset : span.end].view(span.shape)
        self.state = ShardState.UNSHARDED
        self.reshard()

    @property
    def node_shared(self) -> NodeSharedBuffer | None:
        """Stage 3 on one host: ``full`` lives once per host in shared memory (this rank owns one slice of it)."""
        return self._node

    def drop_full(self) -> None:
        """The engine lets the module go: forget ``full`` (a node-shared buffer is unmapped with the last view)."""
        self.full, self._node = torch.empty(0, dtype=self.full.dtype, device=self.full.device), None

    def write_initial_value(self, index: int, value: Tensor) -> None:
        """Deferred construction: parameter ``index``'s whole initial value. This rank keeps its part of the
        shard, and at stages 1/2 the full value (every rank replays the same values, so nothing is gathered)."""
        flat_value = value.detach().reshape(-1)
        span = self.layout.spans[index]
        with torch.no_grad():
            if self.keeps_full:
                self.full[span.offset : span.end].copy_(flat_value)
            if not (self.keeps_full and self.shard_aliases_full):  # else written into `full` just now
                start, end = self.layout.shard_range(self.ctx.rank)
                lo, hi = max(span.offset, start), min(span.end, end)
                if lo < hi:
                    self.shard[lo - start : hi - start].copy_(flat_value[lo - span.offset : hi - span.offset])

    def write_shard_range(self, index: int, param_start: int, values: Tensor) -> None:
        """Elements ``[param_start, param_start + len(values))`` of parameter ``index``, which must lie in this
        rank's shard, into the shard (pretrained loading; publish the shard afterwards)."""
        span = self.layout.spans[index]
        start, _ = self.layout.shard_range(self.ctx.rank)
        offset = span.offset + param_start - start
        with torch.no_grad():
            self.shard[offset : offset + values.numel()].copy_(values)

    def _carve_master_pieces(
        self, group_index_of: dict[int, int]
    ) -> tuple[list[nn.Parameter], list[int], list[int]]:
        """Split this rank's shard at optimizer-group boundaries (parameters were sorted by group)."""
        if not self.trainable:
            return [], [], []
        pieces: list[nn.Parameter] = []
        group_indices: list[int] = []
        offsets: list[int] = []
        start, end = self.layout.shard_range(self.ctx.rank)
        for group_index, (lo, hi) in group_ranges(self.layout, self.params, group_index_of):
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                pieces.append(nn.Parameter(self.shard[lo - start : hi - start], requires_grad=True))
                group_indices.append(group_index)
                offsets.append(lo - start)
        return pieces, group_indices, offsets

    # ----------------------------------------------------------------------------------- shard / unshard
    def start_unshard(self) -> None:
        """Allocate ``full`` and start gathering every rank's shard into it (asynchronously where possible)."""
        if self.state is ShardState.UNSHARDED or self._pending is not None:
            return
        if self._node is not None:  # the peers' slices are read where they lie: the all-gather this replaces
            self.log.record("all_gather", self.full.numel() * self.full.element_size())
            self.state = ShardState.UNSHARDED
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.full.numel() * self.full.element_size())
        secondary = self.secondary
        if secondary is not None and secondary.fresh:  # hierarchical stage 3: gathered inside the node
            self._pending = secondary.start_gather(self.full, self.log, self.ctx.point_to_point, self._salt)
        else:
            self._pending = all_gather_flat(
                self.full, self._gather_source(), self.ctx.group, self.log, True, self.ctx.point_to_point, self._salt,
                self._streams,
            )
            self._fills_secondary = secondary is not None
        if self.watch is not None and self._pending.work is not None:
            self._pending = self._pending._replace(work=self.watch.watched("gather", self.label, self._pending.work))

    def finish_unshard(self) -> None:
        """Wait for the gather started by :meth:`start_unshard`; afterwards the module's parameters are usable."""
        if self.state is ShardState.UNSHARDED:
            return
        if self._pending is None:
            self.start_unshard()
            if self.state is ShardState.UNSHARDED:  # node-shared buffer: nothing to wait for
                return
        self._land_gather()
        if self.placement is not None:
            self.placement.after_host_read()

    def _land_gather(self) -> None:
        """Wait for the gather in flight; ``full`` holds the parameters afterwards."""
        assert self._pending is not None
        self._pending.wait()
        self._pending = None
        self.state = ShardState.UNSHARDED
        if self._fills_secondary and self.secondary is not None:
            self.secondary.keep_slice_of(self.full)
            self._fills_secondary = False

    def reshard(self) -> None:
        """Free ``full``'s storage; the module's parameter views keep their shapes but hold no memory."""
        if self._pending is not None:  # a prefetch nobody used: let it land before freeing its buffer
            self._land_gather()
        if self.state is ShardState.SHARDED:
            return
        self.in_place.check(HOST_WIDE if self._node is not None else GATHERED)
        if self._node is not None:  # the buffer stays (it is the peers' too); its pages leave our resident set
            self._node.release_peer_pages()
        else:
            self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    def start_publish_shard(self) -> Callable[[], None]:
        """The shard changed (an optimizer step, a checkpoint load): make the module see the new values. Stage 3
        drops any gathered copy (the next forward gathers the new values); stages 1/2 start re-gathering
        ``full``. Returns the function that waits for it."""
        if self.keeps_full:
            return self.start_refresh_full_from_shards()
        if self._node is not None and not self.shard_aliases_full:  # our slice of the node's buffer, rounded
            self.full[slice(*self.layout.shard_range(self.ctx.rank))].copy_(self.shard)
        self.reshard()
        if self.secondary is not None:
            self.secondary.mark_stale()
        return lambda: None

    def release_gathered(self) -> None:
        """Free ``full`` where this FlatParam does not keep it (stage 3); stages 1/2 always keep it."""
        if not self.keeps_full:
            self.reshard()

    def start_refresh_full_from_shards(self) -> Callable[[], None]:
        """Stages 1/2 after a step: start gathering the updated shards into ``full``; the returned function waits."""
        assert self.state is ShardState.UNSHARDED
        exchange, full = self.exchange, self.full
        pending: PendingGather | SharedExchangeOp
        if exchange is not None and exchange.fits(full.numel() * full.element_size()):  # one host's CPU ranks
            buffer = exchange.next_buffer(full.numel(), full.dtype)
            buffer.chunk(self.ctx.world_size)[self.ctx.rank].copy_(self.shard)
            pending = exchange.start_gather(buffer, full, self.log, self.label, self.shard_aliases_full)
        else:  # the gather must not read from the buffer it writes: copy the shard when it is a view of `full`
            source = self.shard.clone() if self.shard_aliases_full else self._gather_source()
            pending = all_gather_flat(
                full, source, self.ctx.group, self.log, True, self.ctx.point_to_point, streams=self._streams
            )

        def finish() -> None:
            pending.wait()
            if self.placement is not None:
                self.placement.after_host_read()

        return finish

    def _gather_source(self) -> Tensor:
        """This rank's slice in the compute dtype, on the compute device."""
        if self._device_source is not None:
            return self._device_source
        return host_to_device(self.shard, self.full.device, self.full.dtype)  # without blocking the host

    @property
    def device_source(self) -> Tensor | None:
        """The device-side compute copy of an offloaded shard (GPU with host masters), or None."""
        return self._device_source

    def refresh_device_source(self) -> None:
        """After a step on offloaded masters: update the device-side compute copy."""
        if self._device_source is not None:
            copy_host_to_device(self._device_source, self.shard)

    # ------------------------------------------------------------------------------------------ gradients
    @property
    def reduce_bytes(self) -> int:
        """Size of this FlatParam's flattened gradient, the input of each of its reductions."""
        return self.layout.padded_numel * (self.reduce_dtype or self.full.dtype).itemsize

    def has_pending_grads(self) -> bool:
        return self.trainable and (self.grad_stash is not None or any(p.grad is not None for p in self.params))

    def discard_grads(self) -> None:
        """Drop every gradient of this FlatParam (a skipped step)."""
        self.finish_reduce()  # the exchange must complete on every rank, whatever we do with its result
        self.replica_average_pending = False  # every replica skips the same step: none averages
        self.settle_host_grads()
        self.grad_stash = None
        self.grad_seen = [False] * len(self.params)
        for param in self.params:
            param.grad = None
        for piece in self.master_pieces:
            piece.grad = None

    def reduce_grads(self) -> None:
        """Reduce-scatter the module's gradients and accumulate this rank's slice into the master pieces' grads.

        The module's ``.grad`` tensors are released afterwards: the slice is now the only copy.
        """
        self.start_reduce()
        self.finish_reduce()

    def start_reduce(self, force: bool = False) -> None:
        """Flatten the module's gradients (releasing them) and start reduce-scattering them; :meth:`finish_reduce`
        adds the result to the master pieces' grads. One reduction per FlatParam is in flight at a time.

        ``force``: reduce even without a local gradient (zeros), because a peer has one and every rank must take
        part in every exchange (see [Note: collective order] in hooks.py)."""
        if not (self.has_pending_grads() or (force and self.trainable)):
            return
        self.finish_reduce()
        dtype = self.reduce_dtype or self.full.dtype
        exchange = self.exchange
        if exchange is not None and self.reduces_in_shared_memory:
            arena = exchange.next_buffer(self.layout.padded_numel, dtype)
            self._pending_reduce = exchange.start_reduce(flatten_grads(self, dtype, arena), self.log, self.label)
            return
        self._pending_reduce = start_reduce_scatter_mean(
            flatten_grads(self, dtype), self.ctx.group, self.log, self.ctx.point_to_point, self._streams
        )
        watch = self.watch
        if watch is not None:
            self._pending_reduce.watch(lambda work: watch.watched("reduce", self.label, work))

    @property
    def reduces_in_shared_memory(self) -> bool:
        """Its reductions go through the host's shared-memory arenas (see [Note: shared-memory reductions])."""
        return self.exchange is not None and self.exchange.fits(self.reduce_bytes)

    def finish_reduce(self) -> None:
        """Wait for the reduction started by :meth:`start_reduce` and accumulate this rank's slice (in fp32, where
        the master pieces live)."""
        if self._pending_reduce is None:
            return
        reduced, self._pending_reduce = self._pending_reduce.wait(), None
        replicas = self.ctx.replicas
        self.replica_average_pending = replicas is not None and replicas.count > 1 and bool(self.master_pieces)
        if self._streams is not None and self._streams.enabled and reduced.is_cuda and self.shard.device.type == "cpu":
            self._start_host_grads(reduced, self._streams)
            return
        self._accumulate(
            (piece, offset, reduced[offset : offset + piece.numel()])
            for piece, offset in zip(self.master_pieces, self.piece_offset, strict=True)
        )

    def _accumulate(self, slices: Iterable[tuple[nn.Parameter, int, Tensor]]) -> None:
        """Add each (master piece, its offset in the shard, reduced values) to the piece's gradient, creating it
        on the first reduction of a step."""
        for piece, offset, values in slices:
            if piece.grad is not None:
                piece.grad.add_(values.to(piece.device))
            elif self._grad_file is not None:  # see [Note: gradient slices in files]
                piece.grad = self._grad_file[offset : offset + piece.numel()]
                piece.grad.copy_(values)
            else:  # the reduced slice is ours alone and its pieces are disjoint: used without a copy
                piece.grad = values.to(device=piece.device, dtype=piece.dtype)
        if self._grad_file is not None and self.placement is not None:
            self.placement.after_host_read()  # the slice is in the file: its pages leave this process

    def _start_host_grads(self, reduced: Tensor, streams: CollectiveStreams) -> None:
        """Offloaded masters on a GPU: copy the reduced slice to pinned host memory on the copy stream, without
        blocking; :meth:`settle_host_grads` adds it to the master pieces' grads. One copy in flight per FlatParam
        (the previous one is settled first), so host memory holds at most one extra slice."""
        self.settle_host_grads()
        host, self._host_grads_ready = streams.copy_to_host(reduced, self.shard.dtype)
        self._host_grads_keep = [reduced]
        for piece, offset in zip(self.master_pieces, self.piece_offset, strict=True):
            self._host_grads.append((piece, offset, host[offset : offset + piece.numel()]))

    def settle_host_grads(self) -> None:
        """Wait for the copies :meth:`_start_host_grads` started and accumulate them (the host reads them next: the
        CPU optimizer, the norm). Also orders any earlier non-blocking host-to-device read of the shard before the
        optimizer writes it: the copy stream waited for the compute stream, where those reads were queued."""
        if self._host_grads_ready is None:
            return
        self._host_grads_ready.synchronize()  # type: ignore[attr-defined]
        self._accumulate(self._host_grads)
        self._host_grads, self._host_grads_keep, self._host_grads_ready = [], [], None

    def note_local_use(self) -> None:
        """Mark the parameters holding a gradient not yet flattened (stage 1 keeps them until the step) as used."""
        self.grad_seen = [seen or p.grad is not None for seen, p in zip(self.grad_seen, self.params, strict=True)]

    def requires_grad_now(self) -> bool:
        """Whether autograd can produce a gradient for this FlatParam at all (a GAN toggles ``requires_grad``)."""
        return self.trainable and any(param.requires_grad for param in self.params)

    def unused_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of this rank's shard holding parameters that produced no gradient this step."""
        seen = dict(zip(self.names, self.grad_seen, strict=True))
        overlaps = self.layout.overlaps(self.ctx.rank)
        return [(o.shard_start, o.shard_start + o.numel) for o in overlaps if not seen[o.name]]

    # ------------------------------------------------------------------------------------------- teardown
    def settle_gather(self) -> None:
        """Let a gather in flight land (before the engine lets the module go, see core/release.py)."""
        if self._pending is not None:
            self.finish_unshard()

    @property
    def shard_is_borrowed(self) -> bool:
        """The shard is a view of ``full`` (private, or the node's shared buffer), dropped when the engine lets go."""
        return self.shard_aliases_full
