"""``zero-estimate``'s arithmetic: the per-rank bytes of each category for one configuration, before a run.

The arithmetic mirrors what the core allocates (``core/flat/storage.py``, ``core/runtime/hooks.py``,
``core/flat/placement.py``), not the ZeRO paper; where the two differ the code wins. Ψ = parameters, N = ranks,
c = compute-dtype bytes:

- parameters (compute copies): stages 1/2 keep the whole padded flat buffer, cΨ. Stage 3 keeps nothing at rest;
  during forward/backward the root unit (embeddings, head: whatever is in no ``ModuleList`` child) stays whole,
  plus the unit computing and, with prefetch, the next one. The all-gather writes straight into those buffers, so
  there is no separate gather buffer (prefetch adds one unit here, not to "communication"). Stage 3 on CPU ranks
  (assumed on one host) without offload instead keeps each unit's buffer once per host in shared memory and
  reads it in place (see [Note: shared-memory gathers]): each rank is charged its own slice, cΨ/N, at rest and
  at the peak alike (the peers' pages it maps while a unit is in use are theirs).
- master weights: the fp32 slice, 4Ψ/N; a view of the parameters (0 bytes) in fp32 without offload at stages 1/2
  and in stage 3's shared buffers.
- gradients: stage 1 keeps full-size gradients until the step (fp32 ``.grad`` in fp32; under mixed precision an
  fp32 stash, so 4Ψ, where the paper counts 2Ψ); stages 2/3 keep only the fp32 slice 4Ψ/N (paper: 2Ψ/N).
- optimizer state: bytes per fp32 master element from :data:`OPTIMIZER_STATE_BYTES`, on this rank's slice.
- communication: transient buffers of the largest unit — the flat reduce buffer, the reduce-scatter output, the
  gather source copy and, at stages 2/3, the ``.grad`` tensors waiting for the reduction (the root's wait longest).
  CPU ranks reduce through ``ARENAS`` (2) shared-memory arenas of the largest flattened gradient instead of the flat
  buffer (see [Note: shared-memory reductions]); they are held for the whole run.
- offload "cpu": masters, gradient slices and optimizer state move to host memory, but on a GPU a compute-dtype
  copy of the slice (cΨ/N) stays on the device so gathers need no host-to-device copy (unless ``offload_param``).
  "nvme": masters, gradient slices and optimizer state go to files, a chunk of them resident while the optimizer
  steps. ``offload_param`` without ``offload_optimizer`` changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_strategy.config import OffloadDevice
from zero_strategy.core.comm.engine_comms import ARENA_CAP_BYTES, ARENAS
from zero_strategy.core.stage import ZeroStage
from zero_strategy.estimate.results import Placed
from zero_strategy.estimate.shapes import FlatSpec, ModelShape


@dataclass(frozen=True, slots=True)
class RunSetup:
    """One configuration, as the engine would run it."""

    world_size: int
    stage: ZeroStage
    reduce_dtype: torch.dtype | None  # None: in the compute dtype (no mixed-precision policy)
    offload_optimizer: OffloadDevice
    offload_param: OffloadDevice
    state_bytes: int  # per fp32 master element
    prefetch: bool
    nvme_chunk_numel: int
    accelerator: bool  # the compute device is not the host (a GPU)
    network: bool  # collectives="point_to_point": no shared-memory gathers or reductions

    @property
    def shared_reductions(self) -> bool:
        """CPU ranks (assumed on one x86-64 host) reduce through ``ARENAS`` shared-memory arenas of the largest
        flattened gradient each, held for the whole run (see [Note: shared-memory reductions]); not stage 3 with
        offload."""
        offloaded = self.offload_optimizer is not OffloadDevice.none or self.offload_param is not OffloadDevice.none
        one_host_cpus = not self.accelerator and self.world_size > 1 and not self.network
        return one_host_cpus and not (self.stage.reshards_parameters and offloaded)

    @property
    def shared_parameters(self) -> bool:
        """Stage 3 on CPU ranks (assumed on one host) without offload: each unit's parameters once per host in
        shared memory, this rank owning one slice, read in place (see [Note: shared-memory gathers])."""
        one_host_cpus = not self.accelerator and self.world_size > 1 and not self.network
        return self.stage.reshards_parameters and one_host_cpus and not self.has_placement

    @property
    def has_placement(self) -> bool:
        """The engine builds a ``Placement`` (and never aliases the master) once anything is offloaded."""
        return OffloadDevice.none is not self.offload_optimizer or OffloadDevice.none is not self.offload_param

    @property
    def device_source(self) -> bool:
        """Offloaded masters, parameters not offloaded, on a GPU: a compute-dtype slice copy stays on the device."""
        offloaded = self.offload_optimizer is not OffloadDevice.none
        return self.accelerator and offloaded and self.offload_param is OffloadDevice.none

    def aliases(self, flat: FlatSpec) -> bool:
        """The master slice is a view of the parameters when both have one dtype and nothing is offloaded: of
        ``full`` at stages 1/2, of the rank's slice of the shared buffer at stage 3 on one host."""
        same_dtype = flat.compute_dtype == flat.master_dtype
        kept_whole = not self.stage.reshards_parameters or self.shared_parameters
        return kept_whole and same_dtype and not self.has_placement

    def master_at(self, nbytes: int) -> Placed:
        if self.offload_optimizer is OffloadDevice.nvme:
            return Placed(nvme=nbytes)
        return Placed(host=nbytes) if self.offload_optimizer is OffloadDevice.cpu else Placed(device=nbytes)

    def grad_slice_at(self, nbytes: int) -> Placed:
        # cpu offload: piece.grad is created on the master's device (host); nvme: in a file of its own
        if self.offload_optimizer is OffloadDevice.nvme:
            return Placed(nvme=nbytes)
        return Placed(device=nbytes) if self.offload_optimizer is OffloadDevice.none else Placed(host=nbytes)


def parameters_bytes(shape: ModelShape, s: RunSetup) -> Placed:
    n = s.world_size
    if s.shared_parameters:  # this rank's slice of each shared buffer; the peers' slices are theirs
        return Placed(device=sum(f.shard(n) * f.compute_dtype.itemsize for f in shape.flats))
    device = sum(f.padded(n) * f.compute_dtype.itemsize for f in shape.flats)
    if s.stage.reshards_parameters:  # root + the unit computing (+ the next, prefetched), never more than the model
        whole = shape.root + shape.largest * (2 if s.prefetch else 1)
        device = min(device, sum(f.padded(n) * f.compute_dtype.itemsize for f in whole))
    if s.device_source:
        device += sum(f.shard(n) * f.compute_dtype.itemsize for f in shape.flats)
    return Placed(device=device)


def master_bytes(shape: ModelShape, s: RunSetup) -> Placed:
    nbytes = sum(f.shard(s.world_size) * f.master_dtype.itemsize for f in shape.flats if not s.aliases(f))
    return s.master_at(nbytes)


def gradients_bytes(shape: ModelShape, s: RunSetup) -> Placed:
    trained = [f for f in shape.flats if f.trainable]
    if not s.stage.reduces_every_microstep:  # full gradients until the step: .grad in fp32, else the padded fp32 stash
        return Placed(device=sum(4 * (f.numel if f.compute_dtype == torch.float32 else f.padded(s.world_size))
                                 for f in trained))  # fmt: skip
    return s.grad_slice_at(sum(f.shard(s.world_size) * f.master_dtype.itemsize for f in trained))


def optimizer_state_bytes(shape: ModelShape, s: RunSetup) -> Placed:
    masters = sum(f.shard(s.world_size) * f.master_dtype.itemsize for f in shape.flats if f.trainable)
    state = s.master_at(masters * s.state_bytes // 4)  # the state has the masters' dtype
    if s.offload_optimizer is OffloadDevice.nvme:  # one chunk of masters + gradients + state resident while it steps
        state = state + Placed(host=min(4 * s.nvme_chunk_numel, masters) * (4 + 4 + s.state_bytes) // 4)
    return state


def _gather_staging(f: FlatSpec, s: RunSetup) -> int:
    """Bytes of the temporary an all-gather sends from: stages 1/2 clone an aliasing slice (a gather must not read
    the buffer it writes); otherwise the slice is converted/moved to the compute dtype and device unless it already
    is there or a device copy is kept."""
    shard = f.shard(s.world_size)
    if s.shared_parameters:  # nothing is gathered
        return 0
    if s.aliases(f):
        return shard * f.master_dtype.itemsize
    if s.device_source:
        return 0
    moved = s.accelerator and s.offload_optimizer is not OffloadDevice.none
    return shard * f.compute_dtype.itemsize if moved or f.compute_dtype != f.master_dtype else 0


def _reduce_buffers(f: FlatSpec, s: RunSetup) -> int:
    """The flat reduce buffer (stage 1 in mixed precision reuses its fp32 stash when reducing in fp32) and the
    reduce-scatter output."""
    n = s.world_size
    r = (s.reduce_dtype or f.compute_dtype).itemsize
    stash_reused = not s.stage.reduces_every_microstep and f.compute_dtype != torch.float32 and r == 4
    in_arena = s.shared_reductions and f.padded(n) * r <= ARENA_CAP_BYTES  # flattened into an arena (below)
    return (0 if stash_reused or in_arena else f.padded(n) * r) + f.shard(n) * r


def communication_bytes(shape: ModelShape, s: RunSetup) -> Placed:
    unit = max((shape.root, shape.largest), key=lambda flats: sum(f.numel for f in flats))
    nbytes = sum(_gather_staging(f, s) + (_reduce_buffers(f, s) if f.trainable else 0) for f in unit)
    if s.shared_reductions:  # the arenas, each sized for the largest flattened gradient under the cap
        n = s.world_size
        sizes = [f.padded(n) * (s.reduce_dtype or f.compute_dtype).itemsize
                 for f in shape.root + shape.largest if f.trainable]  # fmt: skip
        nbytes += ARENAS * max([size for size in sizes if size <= ARENA_CAP_BYTES], default=0)
    if s.stage.reduces_every_microstep:  # .grad of the unit being finished and of the root (its gradient lands last)
        nbytes += sum(f.numel * f.compute_dtype.itemsize for f in shape.largest + shape.root if f.trainable)
    return Placed(device=nbytes)


def notes(shape: ModelShape, s: RunSetup, activations_known: bool) -> tuple[str, ...]:
    offloaded = s.offload_optimizer is not OffloadDevice.none
    prefetched = " + the prefetched one" if s.prefetch else ""
    candidates = (
        (any(s.aliases(f) for f in shape.flats) and not s.shared_parameters,
         "fp32 stages 1/2: the master slice is a view of the parameters"),
        (not s.stage.reduces_every_microstep,
         "stage 1 keeps full-size fp32 gradients until the step (paper: 2Ψ in mixed precision)"),
        (s.stage.reshards_parameters and not s.shared_parameters,
         f"stage 3: root unit + the unit computing{prefetched} are whole in forward/backward"),
        (s.shared_parameters, "stage 3 on one host's CPUs: each unit's parameters once per host in shared memory, "
         "this rank's slice (cΨ/N) its own and, in fp32, its master slice"),
        (s.device_source, "offloaded masters on a GPU: a compute-dtype copy of the slice (cΨ/N) stays on the device"),
        (s.offload_optimizer is OffloadDevice.nvme, "nvme: masters, gradient slices and optimizer state in files; "
         "one chunk of them is resident while stepping"),
        (s.offload_param is not OffloadDevice.none and not offloaded,
         "offload_param without offload_optimizer: the slices stay on the device (no effect)"),
        (shape.guessed_units, "unit sizes guessed from a transformer shape: pass largest_unit_numel / root_unit_numel"),
        (not activations_known, "activations not included: pass a model and sample_batch (or activation_bytes)"),
    )
    return tuple(text for applies, text in candidates if applies)
