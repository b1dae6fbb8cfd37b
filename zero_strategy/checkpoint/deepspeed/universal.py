"""Reading the universal layout ``ds_to_universal`` writes (see [Note: DeepSpeed's directory layouts] in
checkpoint/deepspeed/layout.py): each parameter's fp32 weights and optimizer states whole, one small file each
(``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``, its Adam step in ``step.pt``), beside the model-states file of
the run that saved it. No partitions to map: an element range is a slice of the memory-mapped file.

``zero/optimizer_state.pt`` keeps what is not per parameter: the param groups' hyper-parameters, the loss scaler
and the stage. (A universal checkpoint without it reads as one with empty hyper-parameters: the load then leaves
the resuming run's own.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import CheckpointError, FlatEntry
from zero_strategy.checkpoint.deepspeed.layout import UNIVERSAL_PARAMS, find_files
from zero_strategy.checkpoint.deepspeed.reader import WEIGHTS, DeepSpeedCheckpoint, local_name
from zero_strategy.checkpoint.deepspeed.unpickle import LossScalerState, load_deepspeed_file

FP32 = "fp32"
OPTIMIZER_STATE = "optimizer_state.pt"  # beside the parameter folders: param groups, loss scaler, stage
STEP = "step"


class UniversalCheckpoint(DeepSpeedCheckpoint):
    """A universal DeepSpeed checkpoint, read as :class:`DeepSpeedCheckpoint` reads the partitioned layouts."""

    def _open_partitions(self) -> None:
        zero = self.files.tag_dir / UNIVERSAL_PARAMS
        self._dirs = {entry.name: entry for entry in zero.iterdir() if entry.is_dir()}
        optimizer_file = zero / OPTIMIZER_STATE
        self._optimizer = load_deepspeed_file(optimizer_file) if optimizer_file.is_file() else {}
        config = self.model_states.get("ds_config") or {}
        self.stage = int(self._optimizer.get("zero_stage", (config.get("zero_optimization") or {}).get("stage", 0)))
        self.world_size = int(self.model_states.get("dp_world_size", 1))
        missing = [
            local_name(n) for g in self.model_states["param_shapes"] for n in g if not self._file(local_name(n), FP32)
        ]
        if missing:
            raise CheckpointError(f"{zero}: no {FP32}.pt for the parameters {missing[:5]}")

    def _file(self, name: str, what: str) -> Path | None:
        folder = self._dirs.get(name) or self._dirs.get(f"_forward_module.{name}")
        return folder / f"{what}.pt" if folder is not None and (folder / f"{what}.pt").is_file() else None

    def _whole(self, name: str, what: str) -> Tensor:
        file = self._file(name, what)
        if file is None:
            raise CheckpointError(f"{self.files.tag_dir / UNIVERSAL_PARAMS}: no {what}.pt for {name!r}")
        content = load_deepspeed_file(file, "universal checkpoint file")
        value = content.get("param")
        if not isinstance(value, Tensor):
            raise CheckpointError(f"{file} holds no 'param' tensor")
        return value.detach().reshape(-1)

    def read_param(
        self, name: str, tensor_of: str = WEIGHTS, start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        name = self.aliases.get(name, name)
        numel = self.params[name][1].numel
        count = numel - start if count is None else count
        what = FP32 if tensor_of == WEIGHTS else tensor_of.removeprefix("optim:")
        if what != FP32 and self._file(name, what) is None:
            return torch.zeros(count, dtype=torch.float32)  # frozen: no optimizer state
        return self._whole(name, what)[start : start + count].float().clone()

    def _states_of(self, name: str) -> list[str]:
        folder = self._dirs.get(self.aliases.get(name, name))
        return sorted(f.stem for f in folder.glob("*.pt") if f.stem not in (FP32, STEP)) if folder else []

    def state_names(self, flat: FlatEntry, optimizer: int | None = None) -> list[str]:
        return self._states_of(flat.key)

    def scalar_state_at(self, flat: FlatEntry, position: int, optimizer: int | None = None) -> dict[str, Any]:
        file = self._file(self.aliases.get(flat.key, flat.key), STEP)
        if file is None:
            return {}
        value = torch.load(os.fspath(file), map_location="cpu", weights_only=True)
        if not isinstance(value, Tensor):
            raise CheckpointError(f"{file} holds a {type(value).__name__}, not the step tensor")
        return {STEP: {"value": value.item(), "tensor": True, "dtype": str(value.dtype).removeprefix("torch.")}}

    def stored_state_names(self) -> set[str]:
        names = {state for name in self._dirs for state in self._states_of(local_name(name))}
        return names | ({STEP} if any((d / f"{STEP}.pt").is_file() for d in self._dirs.values()) else set())

    def param_groups(self, optimizer: int | None = None) -> list[tuple[dict[str, Any], list[str]]]:
        stored = self._optimizer.get("param_groups") or []
        groups: list[tuple[dict[str, Any], list[str]]] = []
        for index, group in enumerate(self.model_states["param_shapes"]):
            members = [local_name(n) for n in group]
            members += [alias for alias, source in self.aliases.items() if source in members]
            hyper = {k: v for k, v in stored[index].items() if k != "params"} if index < len(stored) else {}
            groups.append((hyper, members))
        return groups

    def loss_scaler(self) -> dict[str, Any] | None:
        scaler = self._optimizer.get("loss_scaler")
        return scaler.fields() if isinstance(scaler, LossScalerState) else None


def open_deepspeed(path: str | os.PathLike) -> DeepSpeedCheckpoint:
    """The DeepSpeed checkpoint at ``path``, partitioned or universal."""
    universal = find_files(Path(path)).universal
    return UniversalCheckpoint(path) if universal else DeepSpeedCheckpoint(path)
