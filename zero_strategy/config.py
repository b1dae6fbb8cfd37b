"""What a user can set on a ZeRO run: plain dataclasses, validated when built.

The library takes these dataclasses (or the same names as keywords); only ``examples/`` and ``conf/`` touch Hydra.
Enums rather than ``Literal`` because OmegaConf rejects ``Literal`` in structured configs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from zero_strategy.core.stage import ZeroStage


class OffloadDevice(str, Enum):
    """Where sharded state lives between uses: on the compute device, in host memory, or in files.

    Member names are lower case like their values, because Hydra/OmegaConf parse enums from shell overrides by
    member *name* (``strategy.offload_optimizer=cpu``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class CheckpointFormat(str, Enum):
    """How ``trainer.save_checkpoint`` and ``ModelCheckpoint`` write a checkpoint directory (member names lower case
    like their values, for Hydra overrides such as ``strategy.checkpoint_format=dcp``)."""

    zero = "zero"
    dcp = "dcp"


class MetaInit(str, Enum):
    """How a model built on the meta device gets its values when it is sharded (member names lower case like their
    values, for Hydra overrides such as ``strategy.meta_init=reset_parameters``)."""

    replay = "replay"
    reset_parameters = "reset_parameters"


COLLECTIVE_CHOICES = ("auto", "native", "point_to_point", "shared_memory")
COLLECTIVES_ENV = "ZERO_STRATEGY_COLLECTIVES"
"""Environment variable giving ``ZeroConfig.collectives`` its default (unset or empty: "auto")."""


class ZeroConfigError(ValueError):
    """An invalid ZeRO setting: the message names the key and how to fix it."""


def default_collectives() -> str:
    """``collectives`` when none is given: ``$ZERO_STRATEGY_COLLECTIVES``, else "auto".

    An environment variable rather than a module-level switch because it reaches every rank alike (forked,
    spawned, or a script re-run by the launcher), which is what lets one host's CPU ranks be put on the network
    path that GPUs and several nodes take (e.g. a test suite's second pass)."""
    value = os.environ.get(COLLECTIVES_ENV, "").strip()
    if not value:
        return "auto"
    if value not in COLLECTIVE_CHOICES:
        raise ZeroConfigError(
            f"${COLLECTIVES_ENV}={value!r}: use one of {', '.join(map(repr, COLLECTIVE_CHOICES))}, or unset it "
            "(then collectives defaults to 'auto')."
        )
    return value


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """Options of :class:`zero_strategy.ZeroStrategy` (everything except the Lightning plumbing)."""

    stage: int = 3
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""

    unit_modules: list[str] = field(default_factory=list)
    """Class names (``"Block"``) or dotted paths of modules that each become one communication unit (the
    transformer block, typically). Empty: automatic (children of ``nn.ModuleList`` plus the size threshold)."""

    min_unit_numel: int = 1_000_000
    """Automatic units: a module whose not-yet-assigned parameters reach this many elements becomes a unit."""

    prefetch: bool = True
    """Stage 3: start the all-gather of the next unit while the current one computes."""

    collectives: str = field(default_factory=default_collectives)
    """How all-gathers and reduce-scatters run: "native" (the backend's own collectives), "point_to_point" (each
    rank exchanges its chunks with every peer directly), "shared_memory" (every rank on one host's CPU: stage 3
    keeps each unit's parameters once per host in /dev/shm and reads them in place, gathering nothing; on x86-64
    gradients are reduced, and stages 1/2 gather their updated slices, through buffers in /dev/shm too; not for
    stage 3 with offload) or "auto": on gloo, shared memory where it applies and point-to-point otherwise (both
    measured faster than gloo's own collectives), native elsewhere (NCCL's collectives are already optimal).
    Default: ``$ZERO_STRATEGY_COLLECTIVES`` if set, else "auto". Setting it to "point_to_point" or "native" puts
    one host's CPU ranks on the path every GPU and multi-node run takes (stage 3 frees its parameters and gathers
    them through the network) without changing any code; an explicit ``collectives=`` still wins."""

    broadcast_buffers: bool = True
    """Before every training forward (module in training mode, gradients enabled) every rank copies rank 0's
    buffers (BatchNorm running statistics; every buffer, whatever its dtype): each training forward starts from rank
    0's statistics, then updates this rank's copy with this rank's batch; a checkpoint saves rank 0's. Evaluation
    forwards never broadcast: each rank evaluates with the statistics it holds. (Whatever this option's value,
    buffers are adopted from rank 0 once when the model is sharded, as DDP does when it wraps a model.)

    DDP's option of the same name broadcasts before a forward only when the previous forward synchronised
    gradients, so it differs in two places: with ``accumulate_grad_batches > 1`` DDP broadcasts before the first
    micro-batch of each window only (the window's other micro-batches start from each rank's own statistics), and
    it does broadcast before the first evaluation forward after a training step. Rank 0's statistics, the saved
    ones, are DDP's either way; the other ranks' differ from DDP's with accumulation, and during evaluation.
    Keeping every rank on rank 0's statistics is deliberate. False: no broadcast after the first, each rank keeps
    its own statistics."""

    allow_untested_optimizer: bool = False
    """Accept an optimizer class that is not on the list of element-wise optimizers known to be exact on flat
    slices. Only set this if your optimizer's update of each element depends on that element's history alone."""

    fused_optimizer: bool = True
    """Step Adam, AdamW, SGD and Adagrad with torch's fused kernel (one pass over each master slice; several times
    faster on CPU), keeping the user's optimizer object and hyper-parameters. Results agree with torch's default
    loop to fp32 rounding, not bit for bit. Only a param group left at torch's defaults (``fused=None``,
    ``foreach=None``) is switched; an explicit ``fused=False`` or ``foreach=...`` is respected. False: torch's own
    choice everywhere."""

    process_group_timeout_s: float = 1800.0
    """Seconds a collective may wait before the process group gives up (torch's default is 30 minutes)."""

    offload_optimizer: OffloadDevice = OffloadDevice.none
    """Where the fp32 master slices, their gradients and the optimizer state live: "none" (compute device),
    "cpu" (host memory; the optimizer steps on the CPU) or "nvme" (files under nvme_path, stepped in chunks)."""

    offload_param: OffloadDevice = OffloadDevice.none
    """Stage 3: where the parameter slices wait between gathers: "none" (compute device), "cpu" or "nvme"
    (requires offload_optimizer="nvme": the slices are read from the master files)."""

    nvme_path: str | None = None
    """Directory for "nvme" offload files (a fast local disk); a per-run folder inside it is removed at teardown."""

    pin_memory: bool = True
    """Pin host buffers when the compute device is a GPU (faster, asynchronous copies)."""

    nvme_chunk_numel: int = 16 * 1024 * 1024
    """"nvme": elements per optimizer-step chunk; resident memory of the step is bounded by a few chunks."""

    full_params_after_fit: bool | None = None
    """What the module holds when the engine is released (end of fit/validate/test): True gathers full
    parameters on every rank; False leaves them on the meta device, the weights staying in this strategy's shards
    (save with ``trainer.save_checkpoint``); None (auto) gathers unless the model was built sharded at stage 3,
    where the gather would put the whole model on every rank at once."""

    keep_window_gradients: bool | None = None
    """The Trainer, stages 2/3, ``accumulate_grad_batches > 1`` on several processes: whether an accumulation window
    keeps its gradients on the module until its last backward (DDP's memory of full gradients, one reduction per
    window), so that ``p.grad`` read inside the window is DDP's value (this rank's own sum); without the hold they
    are reduced after each backward (ZeRO's memory) and such a read raises ``GradientReadError``. None (auto): held
    when the LightningModule or a callback overrides ``on_after_backward``, or the LightningModule or a callback
    not defined in ``lightning``/``zero_strategy`` overrides ``on_train_batch_end``. True: every window (reads
    anywhere in it, ``training_step`` too). False: never. Stage 1 keeps gradients until the step anyway, and
    Fabric's ``no_backward_sync`` always holds: the option is the Trainer's."""

    activation_checkpointing: list[str] = field(default_factory=list)
    """Class names of modules whose forward is recomputed in backward instead of keeping its activations
    (non-reentrant torch checkpointing). ZeroStrategy also accepts classes or a policy callable."""

    profile: bool = False
    """Add a CommunicationProfiler: per-step compute vs. unhidden communication time, bytes and bandwidth per
    collective, logged to the Trainer's loggers and summarised when fit ends."""

    cpu_checkpointing: bool = False
    """With activation checkpointing on a GPU, keep the checkpointed inputs in host memory."""

    pretrained: str | None = None
    """Weights to start from, loaded shard by shard when the model is sharded (each rank reads only the element
    ranges it keeps): a ``.safetensors`` file, a Hugging Face checkpoint (directory or ``*.index.json``), a
    zero_strategy checkpoint or consolidated file, or a torch ``.pt``/``.bin``/``.ckpt`` (memory-mapped,
    ``weights_only``). Keys must match the LightningModule's ``state_dict``; for renaming keys or loading into a
    submodule use ``zero_strategy.load_pretrained`` in ``configure_model``."""

    pretrained_strict: bool = True
    """With ``pretrained``: missing and unexpected keys are an error (False: load what matches, e.g. a new head)."""

    checkpoint_format: CheckpointFormat = CheckpointFormat.zero
    """"zero": this package's sharded directory (manifest.json and one safetensors shard per rank; zero-to-fp32
    consolidates it). "dcp": a torch.distributed.checkpoint directory, each rank writing the boxes of its own slices,
    which FSDP2 (``dcp.load`` at any world size), torchtitan and Lightning's ModelParallelStrategy read. Either
    resumes here at any world size and stage, and ``trainer.fit(ckpt_path=...)`` reads both whatever this setting."""

    meta_init: MetaInit = MetaInit.replay
    """How a model built on the meta device (``configure_model``, ``init_module(empty_init=True)``) gets its values
    when it is sharded: "replay" replays its recorded construction (the values an eager build gives, bit for bit);
    "reset_parameters" replays it, then calls every module's ``reset_parameters()`` in module order (FSDP's contract,
    which litgpt's pretraining relies on; see [Note: the reset_parameters contract] in core/init/resets.py)."""

    shard_group_size: Any = None  # int | "node" | None; `Any` because OmegaConf 2.3 rejects Union fields
    """Hybrid sharding: K ranks share one copy of the sharded state (ZeRO inside each group of K consecutive ranks,
    replicas across groups, gradients averaged over the replicas). "node": the ranks of one node (as the launcher
    defines nodes). None: the whole world (flat ZeRO). K must divide the world size."""

    hierarchical_params: Any = None  # int | "node" | None; `Any` for OmegaConf, as shard_group_size
    """Stage 3, hierarchical partitioning (ZeRO++ hpZ): besides the shards across the whole world (the fp32
    masters, gradients and optimizer state, as flat stage 3), each rank keeps 1/K of the compute-dtype parameters,
    K = the ranks of one node ("node") or a number of consecutive ranks. The first gather of each unit after an
    optimizer step crosses the world and fills that copy; every later gather (backward, further micro-steps) stays
    inside the group of K. Costs Ψ/K compute-dtype elements per rank. None: off."""

    tensor_parallel_size: int = 1
    """Tensor parallelism inside ZeRO: the world becomes a mesh ``data_parallel x tensor_parallel`` of K consecutive
    ranks per TP group (inside a node), exposed to ``configure_model`` as ``self.device_mesh`` exactly as Lightning's
    ModelParallelStrategy does; the user's ``parallelize_module`` plan runs over ``tensor_parallel`` and ZeRO shards
    over ``data_parallel``. 1: off. K must divide the world size."""

    def __post_init__(self) -> None:
        if self.stage not in tuple(ZeroStage):
            raise ZeroConfigError(
                f"stage={self.stage!r} is not a ZeRO stage: use 1 (optimizer state sharded), "
                "2 (+ gradients) or 3 (+ parameters)."
            )
        if isinstance(self.unit_modules, str):
            raise ZeroConfigError(
                f"unit_modules={self.unit_modules!r} must be a list of class names, e.g. [{self.unit_modules!r}]."
            )
        if self.min_unit_numel < 1:
            raise ZeroConfigError(f"min_unit_numel={self.min_unit_numel!r} must be a positive element count.")
        if self.collectives not in COLLECTIVE_CHOICES:
            raise ZeroConfigError(
                f"collectives={self.collectives!r}: use one of {', '.join(map(repr, COLLECTIVE_CHOICES))}."
            )
        self._validate_offload()
        try:
            value = self.checkpoint_format
            self.checkpoint_format = CheckpointFormat(value.value if isinstance(value, CheckpointFormat) else value)
        except ValueError:
            raise ZeroConfigError(
                f"checkpoint_format={self.checkpoint_format!r}: use 'zero' (this package's sharded directory) or "
                "'dcp' (a torch.distributed.checkpoint directory)."
            ) from None
        try:
            self.meta_init = MetaInit(self.meta_init.value if isinstance(self.meta_init, MetaInit) else self.meta_init)
        except ValueError:
            raise ZeroConfigError(
                f"meta_init={self.meta_init!r}: use 'replay' (the recorded construction) or 'reset_parameters' "
                "(then every module's reset_parameters(), as FSDP does)."
            ) from None
        offloaded = self.offload_optimizer is not OffloadDevice.none
        if self.collectives == "shared_memory" and self.zero_stage.reshards_parameters and offloaded:
            raise ZeroConfigError(
                'collectives="shared_memory" does not apply to stage 3 with offload (its shards are offloaded, so '
                'its gathers and therefore its reductions go through the network); use "auto" or "point_to_point".'
            )
        if self.pretrained is not None and not os.path.exists(self.pretrained):
            raise ZeroConfigError(f"pretrained={self.pretrained!r} does not exist; give the path of the weights file "
                                  "or checkpoint directory to start from.")
        size = self.shard_group_size
        if size is not None and size != "node" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ZeroConfigError(
                f"shard_group_size={size!r}: use a positive number of ranks that divides the world size, 'node' "
                "(the ranks of one node) or None (the whole world)."
            )
        if self.keep_window_gradients is not None and not isinstance(self.keep_window_gradients, bool):
            raise ZeroConfigError(f"keep_window_gradients={self.keep_window_gradients!r}: use True (hold every "
                                  "accumulation window's gradients), False (never) or None (auto).")
        self._validate_hierarchical()
        self._validate_tensor_parallel()
        if self.process_group_timeout_s <= 0:
            raise ZeroConfigError(
                f"process_group_timeout_s={self.process_group_timeout_s!r} must be a positive number of seconds."
            )

    @property
    def zero_stage(self) -> ZeroStage:
        """``stage`` as a :class:`ZeroStage`, whose properties are the only place the stage's decisions live."""
        return ZeroStage(self.stage)

    def _validate_hierarchical(self) -> None:
        value = self.hierarchical_params
        if value is None:
            return
        if value != "node" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ZeroConfigError(
                f"hierarchical_params={value!r}: use 'node' (a secondary copy per node), a positive number of "
                "consecutive ranks that divides the world size, or None (off)."
            )
        if not self.zero_stage.reshards_parameters:
            raise ZeroConfigError(
                f"hierarchical_params needs stage=3 (stage {self.stage} never gathers parameters in backward); "
                "use stage=3 or drop hierarchical_params."
            )
        if self.shard_group_size is not None:
            raise ZeroConfigError(
                "hierarchical_params and shard_group_size do not combine: hybrid sharding already gathers only "
                "inside a shard group. Use one of them."
            )
        if self.offload_optimizer is not OffloadDevice.none or self.offload_param is not OffloadDevice.none:
            raise ZeroConfigError(
                "hierarchical_params is not supported with offload (the secondary copy would live next to the "
                "offloaded shards); drop offload_optimizer/offload_param or hierarchical_params."
            )

    def _validate_tensor_parallel(self) -> None:
        value = self.tensor_parallel_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ZeroConfigError(f"tensor_parallel_size={value!r}: use a positive number of ranks per tensor-"
                                  "parallel group that divides the world size (1: no tensor parallelism).")
        if value > 1 and (self.shard_group_size is not None or self.hierarchical_params is not None):
            raise ZeroConfigError("tensor_parallel_size does not combine with shard_group_size or "
                                  "hierarchical_params yet: ZeRO shards over the whole data-parallel dimension. "
                                  "Drop one of them.")

    def _validate_offload(self) -> None:
        for key in ("offload_optimizer", "offload_param"):
            value = getattr(self, key)
            try:
                setattr(self, key, OffloadDevice(value.value if isinstance(value, OffloadDevice) else value))
            except ValueError:
                raise ZeroConfigError(f"{key}={value!r}: use 'none', 'cpu' or 'nvme'.") from None
        if self.offload_param is not OffloadDevice.none and not self.zero_stage.reshards_parameters:
            raise ZeroConfigError(
                f"offload_param={self.offload_param.value!r} needs stage=3 (stages 1/2 keep full parameters on "
                "every rank); use stage=3 or offload_optimizer instead."
            )
        if OffloadDevice.nvme in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ZeroConfigError('"nvme" offload needs nvme_path=<a directory on a fast local disk>.')
        if self.offload_param is not OffloadDevice.none and self.offload_optimizer is OffloadDevice.none:
            raise ZeroConfigError(
                f"offload_param={self.offload_param.value!r} needs offload_optimizer too: at stage 3 the parameter "
                "slices are the fp32 master slices the optimizer steps, so they move together."
            )
        if self.offload_param is OffloadDevice.nvme and self.offload_optimizer is not OffloadDevice.nvme:
            raise ZeroConfigError(
                'offload_param="nvme" reads parameter slices from the master files: set offload_optimizer="nvme" too.'
            )
        if self.nvme_chunk_numel < 1024:
            raise ZeroConfigError(f"nvme_chunk_numel={self.nvme_chunk_numel} is too small; use at least 1024.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ZeroConfig:
        """Build from keywords, naming any key that is not an option (rather than a bare ``TypeError``)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ZeroConfigError(
                f"unknown ZeRO option(s) {unknown}; valid options are {sorted(known)}."
            )
        return cls(**kwargs)
