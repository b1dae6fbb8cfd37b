"""A DeepSpeed checkpoint as ``zero-to-fp32`` (and ``--hf``) read our own: the module's state-dict keys with the
parameter behind each, parameters by element range, the buffers and Lightning's trainer state. The export code
then streams it one tensor at a time exactly as it streams our sharded checkpoints (see [Note: streaming
consolidation] in checkpoint/export/consolidate.py): memory near the largest tensor, not the model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from zero_strategy.checkpoint.base.format import BUFFERS_KEY, FlatEntry, ParamEntry
from zero_strategy.checkpoint.deepspeed.state_dict import state_dict_keys
from zero_strategy.checkpoint.deepspeed.universal import open_deepspeed


@dataclass(frozen=True, slots=True)
class ExportManifest:
    """What the export code reads of our manifest, for a DeepSpeed checkpoint."""

    state_dict_keys: list[list[str]]  # [key, "param" | "buffer", parameter name or buffer key]
    checkpoint_id: str
    versions: dict[str, str] = field(default_factory=dict)


class DeepSpeedExportView:
    """A DeepSpeed checkpoint directory, read for export (``ShardedCheckpoint``'s reading side)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._ckpt = open_deepspeed(path)
        self.path = Path(path)
        self.params: dict[str, tuple[FlatEntry, ParamEntry]] = self._ckpt.params
        keys = [[k.key, "param", k.param] if k.param is not None else [k.key, "buffer", k.key]
                for k in state_dict_keys(self._ckpt)]
        client = self._ckpt.client_state()
        versions = {"deepspeed": str(self._ckpt.model_states.get("ds_version", "unknown"))}
        if "pytorch-lightning_version" in client:
            versions["lightning"] = str(client["pytorch-lightning_version"])
        tag = self._ckpt.files.tag_dir.name
        self.manifest = ExportManifest(keys, f"deepspeed-{tag}", versions)

    def read_param(
        self, name: str, tensor_of: str = "flat", start: int = 0, count: int | None = None,
        optimizer: int | None = None,
    ) -> Tensor:
        return self._ckpt.read_param(name, tensor_of, start, count, optimizer)

    def trainer_state(self, weights_only: bool | None = True) -> dict[str, Any]:
        """Lightning's trainer state (its DeepSpeedStrategy's client state; empty for a plain engine's) and the
        buffers. Every file was already read safely (checkpoint/deepspeed/unpickle.py): ``weights_only`` changes
        nothing."""
        client = self._ckpt.client_state()
        state = dict(client) if "pytorch-lightning_version" in client else {}
        state[BUFFERS_KEY] = self._ckpt.buffers()
        return state

    def close(self) -> None:
        self._ckpt.close()

    def __enter__(self) -> DeepSpeedExportView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
