"""Reading a DeepSpeed ZeRO checkpoint (stages 1, 2, 3; fp32, bf16, fp16) by parameter name and element range.

:class:`DeepSpeedCheckpoint` answers what checkpoint/sharded/load.py asks of our own checkpoints
(``ReadableCheckpoint`` in checkpoint/base/source.py): elements ``[start, start + count)`` of a parameter's fp32
master weights or of one of its optimizer states, the state names and the ``step`` of its param group. Each
parameter is presented as a flat entry of its own (offset 0), as the DCP reader does. The files are memory-mapped
(checkpoint/deepspeed/unpickle.py), so a rank touches only the pages of the ranges it reads.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import CheckpointError, FlatEntry, ParamEntry
from zero_strategy.checkpoint.deepspeed.layout import SUPPORTED, DeepSpeedFiles, find_files
from zero_strategy.checkpoint.deepspeed.partitions import PartitionMap
from zero_strategy.checkpoint.deepspeed.unpickle import LossScalerState, load_deepspeed_file

WEIGHTS = "flat"  # ``tensor_of`` for the weights, as ShardedCheckpoint.read_param names it
LIGHTNING_PREFIX = "_forward_module."  # Lightning's DeepSpeedStrategy wraps the LightningModule under this name
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "ds_autoep_layers",
})
"""The model-states keys DeepSpeed itself writes; every other key is the caller's client state (Lightning's
trainer state, for its DeepSpeedStrategy)."""


def local_name(name: str) -> str:
    """A DeepSpeed parameter name relative to the user's module (Lightning's wrapper prefix removed)."""
    return name.removeprefix(LIGHTNING_PREFIX)


def _numel(shape: Any) -> int:
    return math.prod(int(dim) for dim in shape)


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint directory (any level: see [Note: DeepSpeed's directory layouts] in
    checkpoint/deepspeed/layout.py), validated when opened: every rank's file present and readable, the
    partitions the size the parameter shapes need."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files: DeepSpeedFiles = find_files(self.path)
        self.model_states = load_deepspeed_file(self.files.model_states, "DeepSpeed model-states file")
        try:
            trainable = {local_name(n): list(s) for g in self.model_states["param_shapes"] for n, s in g.items()}
        except (KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{self.files.model_states}: no readable param_shapes ({error})") from error
        self._open_partitions()
        self._frozen_shapes = {
            local_name(n): list(s) for n, s in (self.model_states.get("frozen_param_shapes") or {}).items()
        }
        self._rank_models: dict[int, dict[str, Any]] = {}
        self.aliases = {
            local_name(a): local_name(s) for a, s in (self.model_states.get("shared_params") or {}).items()
        }
        if self.model_states.get("frozen_param_shapes") is None and self.stage <= 2:
            self._frozen_shapes = self._unlisted_frozen(trainable)
        shapes = {**trainable, **self._frozen_shapes}
        self.params: dict[str, tuple[FlatEntry, ParamEntry]] = {n: _entry(n, s) for n, s in shapes.items()}
        for alias, source in self.aliases.items():
            if source in self.params:
                self.params[alias] = self.params[source]

    def _open_partitions(self) -> None:
        """Every rank's optimizer-state file: the stage, the fp32 partitions, the inner optimizer's state."""
        if self.files.universal:
            raise CheckpointError(f"{self.path} is a universal checkpoint: open it with open_deepspeed()")
        self._optim = [self._optimizer_part(file) for file in self.files.optim_states]
        self.stage = int(self._optim[0]["zero_stage"])
        self.world_size = len(self._optim)
        vectors = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        inner = "base_optimizer_state" if self.stage <= 2 else "optimizer_state_dict"
        try:
            self._fp32: list[list[Tensor]] = [part[vectors] for part in self._optim]
            self._base: list[dict[str, Any]] = [part[inner] for part in self._optim]
        except KeyError as error:
            raise CheckpointError(f"{self.files.tag_dir}: a stage-{self.stage} file lacks {error}") from error
        groups = [{local_name(n): _numel(s) for n, s in g.items()} for g in self.model_states["param_shapes"]]
        # Every rank's partition of a group is rank 0's size, except that DeepSpeed's bf16 optimizer stores the
        # last rank's without the group's end padding: shorter, never longer.
        sizes = [vector.numel() for vector in self._fp32[0]]
        for rank, rank_vectors in enumerate(self._fp32):
            if len(rank_vectors) != len(sizes) or any(v.numel() > n for v, n in zip(rank_vectors, sizes, strict=True)):
                raise CheckpointError(f"{self.files.optim_states[rank]}: its fp32 partitions do not match rank 0's")
        alignment = self._optim[0].get("param_alignment_paddings") if self.stage <= 2 else None
        try:
            self.partitions = PartitionMap(self.stage, self.world_size, groups, sizes, alignment)
        except CheckpointError as error:
            raise CheckpointError(f"{self.files.tag_dir}: {error}") from error

    def _unlisted_frozen(self, trainable: dict[str, list[int]]) -> dict[str, list[int]]:
        """Frozen parameters DeepSpeed did not list (its fp16 and bf16 optimizers at stages 1/2 record no
        ``frozen_param_shapes``; their values are only in ``module``, in the training dtype): every module entry
        that is neither a buffer, a trainable parameter nor a tied name. (DeepSpeed's own zero_to_fp32 leaves
        them out of its output.)"""
        buffers = {local_name(key) for key in self.model_states.get("buffer_names") or []}
        module = self.model_states.get("module") or {}
        return {
            local_name(key): list(value.shape) for key, value in module.items()
            if local_name(key) not in buffers and local_name(key) not in trainable
            and local_name(key) not in self.aliases and isinstance(value, Tensor)
        }

    def _optimizer_part(self, file: Path) -> dict[str, Any]:
        content = load_deepspeed_file(file, "DeepSpeed optimizer-state file")
        part = content.get("optimizer_state_dict")
        if not isinstance(part, dict) or "zero_stage" not in part:
            raise CheckpointError(f"{file} holds no ZeRO optimizer state (no optimizer_state_dict.zero_stage)")
        return part

    # ------------------------------------------------------------------------------------------- tensors
    def read_param(
        self, name: str, tensor_of: str = WEIGHTS, start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        """Elements of parameter ``name`` (all by default): its fp32 master weights (``"flat"``; a frozen
        parameter's stored values) or an optimizer state (``"optim:<name>"``; zeros for a frozen parameter), as a
        new 1-D CPU tensor."""
        name = self.aliases.get(name, name)
        numel = self.params[name][1].numel
        count = numel - start if count is None else count
        if name in self._frozen_shapes:
            if tensor_of != WEIGHTS:
                return torch.zeros(count, dtype=torch.float32)
            return self._frozen(name, start, count)
        state = None if tensor_of == WEIGHTS else tensor_of.removeprefix("optim:")
        out = torch.empty(count, dtype=torch.float32)
        filled = 0
        for seg in self.partitions.segments(name, start, count):
            vector = self._vector(seg.rank, seg.vector, state)
            out[filled : filled + seg.length].copy_(vector[seg.offset : seg.offset + seg.length])
            filled += seg.length
        return out

    def _vector(self, rank: int, index: int, state: str | None) -> Tensor:
        try:
            value = self._fp32[rank][index] if state is None else self._base[rank]["state"][index][state]
        except (KeyError, IndexError) as error:
            raise CheckpointError(
                f"{self.files.optim_states[rank]}: no {state or 'fp32 weights'!r} for partition {index}"
            ) from error
        if not isinstance(value, Tensor) or value.is_meta or value.numel() == 0:
            # what DeepSpeed leaves in the file for a tensor it kept elsewhere (NVMe offload swaps them out)
            found = "an empty tensor" if isinstance(value, Tensor) else f"a {type(value).__name__}"
            raise CheckpointError(
                f"{self.files.optim_states[rank]}: {state or 'the fp32 weights'} of partition {index} is {found}, "
                f"not its values (a tensor offloaded to NVMe that the checkpoint does not hold?). Supported: "
                f"{SUPPORTED}, with every tensor in the files"
            )
        return value.detach()

    def _frozen(self, name: str, start: int, count: int) -> Tensor:
        """A frozen parameter's values: whole in the model states at stages 1/2, a piece per rank at stage 3."""
        if self.stage <= 2:
            fragments = self.model_states.get("frozen_param_fragments") or {}
            module = self.model_states.get("module") or {}
            value = fragments.get(name, fragments.get(LIGHTNING_PREFIX + name))
            if value is None:
                value = module.get(name, module.get(LIGHTNING_PREFIX + name))
            if value is None:
                raise CheckpointError(f"{self.files.model_states}: frozen parameter {name!r} has no stored values")
            return value.detach().reshape(-1)[start : start + count].float().clone()
        piece = math.ceil(_numel(self._frozen_shapes[name]) / self.world_size)
        out = torch.empty(count, dtype=torch.float32)
        at = start
        while at < start + count:
            rank, inside = divmod(at, piece)
            length = min(start + count - at, piece - inside)
            fragments = self._rank_model(rank).get("frozen_param_fragments") or {}
            stored = fragments.get(name, fragments.get(LIGHTNING_PREFIX + name))
            if stored is None:
                raise CheckpointError(f"{self.files.rank_model_states[rank]}: no fragment of frozen {name!r}")
            out[at - start : at - start + length].copy_(stored.detach().reshape(-1)[inside : inside + length])
            at += length
        return out

    def _rank_model(self, rank: int) -> dict[str, Any]:
        if rank not in self._rank_models:
            self._rank_models[rank] = load_deepspeed_file(self.files.rank_model_states[rank], "model-states file")
        return self._rank_models[rank]

    # ------------------------------------------------------------------------------------- optimizer state
    has_optimizer_state = True
    info = None  # our own writer's record: a DeepSpeed checkpoint has none

    def _partition_of(self, name: str) -> int:
        return self.partitions.segments(self.aliases.get(name, name), 0, 1)[0].vector

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        name = self.aliases.get(flat.key, flat.key)
        if name in self._frozen_shapes:
            return []
        state = self._base[0]["state"].get(self._partition_of(name), {})
        return sorted(key for key, value in state.items() if isinstance(value, Tensor) and value.dim() > 0)

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        name = self.aliases.get(flat.key, flat.key)
        if name in self._frozen_shapes:
            return {}
        state = self._base[0]["state"].get(self._partition_of(name), {})
        records: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() == 0:
                records[key] = {"value": value.item(), "tensor": True,
                                "dtype": str(value.dtype).removeprefix("torch.")}
            elif not isinstance(value, Tensor):
                records[key] = {"value": value, "tensor": False}
        return records

    def stored_state_names(self) -> set[str]:
        """Every state name the inner optimizer stored (per-element and scalar)."""
        return {key for state in self._base[0]["state"].values() for key in state}

    def param_groups(self, optimizer: int | None = None) -> list[tuple[dict[str, Any], list[str]]]:
        """The inner optimizer's param groups as (hyper-parameters, parameter names, tied names included)."""
        stored = self._base[0]["param_groups"]
        names = self.model_states["param_shapes"]
        if len(stored) != len(names):
            raise CheckpointError(
                f"{self.files.optim_states[0]}: {len(stored)} optimizer param groups (sub-groups) for "
                f"{len(names)} parameter groups; a stage-3 sub_group_size that splits a param group is not read"
            )
        groups = []
        for hyper, group in zip(stored, names, strict=True):
            members = [local_name(n) for n in group]
            members += [alias for alias, source in self.aliases.items() if source in members]
            groups.append(({k: v for k, v in hyper.items() if k != "params"}, members))
        return groups

    # ------------------------------------------------------------------------------------- the rest
    def buffers(self) -> dict[str, Tensor]:
        module = self.model_states.get("module") or {}
        return {local_name(key): module[key] for key in self.model_states.get("buffer_names") or [] if key in module}

    def client_state(self) -> dict[str, Any]:
        """What the caller saved beside DeepSpeed's own keys (Lightning's trainer state, under its strategy)."""
        return {key: value for key, value in self.model_states.items() if key not in DEEPSPEED_KEYS}

    def loss_scaler(self) -> dict[str, Any] | None:
        """The fp16 loss scaler's fields (``cur_scale``, ``cur_hysteresis``, ``last_overflow_iter``, ...)."""
        scaler = self._optim[0].get("loss_scaler")
        return scaler.fields() if isinstance(scaler, LossScalerState) else None

    def rng_state(self, rank: int) -> tuple[dict[str, Tensor], str] | None:
        return None  # DeepSpeed saves no RNG state

    def close(self) -> None:
        """Nothing to close: the memory maps go with the tensors."""

    def __enter__(self) -> DeepSpeedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _entry(name: str, shape: list[int]) -> tuple[FlatEntry, ParamEntry]:
    """A parameter as a flat entry of its own, stored in fp32 (the master weights)."""
    param = ParamEntry(name=name, shape=shape, offset=0, numel=_numel(shape), groups=[])
    return FlatEntry(key=name, dtype="float32", optimizers=[], shard_numel=param.numel, params=[param]), param
