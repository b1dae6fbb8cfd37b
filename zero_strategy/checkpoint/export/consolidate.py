"""Consolidation (``zero-to-fp32``): turn a sharded checkpoint directory into one ordinary file.

The output holds exactly the LightningModule's ``state_dict()`` — same keys, same order, tied weights under each
of their keys — with parameters in fp32 and buffers in their own dtype. It loads with plain torch / safetensors
(``.ckpt`` with Lightning's ``load_from_checkpoint``); zero_strategy is not needed to read it.

[Note: streaming consolidation]
For ``.safetensors`` the tensors are produced one at a time by a generator and written as they come, so the
process holds one parameter (plus a bounded read chunk) at a time: the peak is near the largest tensor, not the
model. A parameter is filled from the shards in chunks of at most ``READ_CHUNK_BYTES`` into one preallocated
fp32 tensor; reading it whole would hold the pieces *and* their concatenation when it spans several ranks' shards.
The shards are read with ordinary file reads (no mmap), so the pages the kernel caches do not count against the
process. One at a time means no reference to the previous tensor survives while the next is read: the generator
yields without naming it (:func:`stream_values`) and the writer drops each tensor once written
(``write_safetensors``); either one holding on doubles the peak. The Hugging Face export (hf_export.py) fills its
files from the same stream. ``.pt`` / ``.bin`` / ``.ckpt`` are dictionaries written by ``torch.save``: they hold
the whole model in memory.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import (
    BUFFERS_KEY,
    MANIFEST_NAME,
    PARAM_GROUPS_KEY,
    CheckpointError,
    fsync_directory,
)
from zero_strategy.checkpoint.base.safetensors_io import DTYPE_CODES, READ_CHUNK_BYTES, write_safetensors
from zero_strategy.checkpoint.deepspeed.export_view import DeepSpeedExportView
from zero_strategy.checkpoint.deepspeed.layout import is_deepspeed_directory
from zero_strategy.checkpoint.export.plain_file import read_plain_checkpoint
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.tensor_parallel import is_tensor_parallel_directory
from zero_strategy.checkpoint.sharded.tensor_parallel_view import TensorParallelView

SAFETENSORS_SUFFIX = ".safetensors"
STATE_DICT_SUFFIXES = (".pt", ".bin")
LIGHTNING_SUFFIX = ".ckpt"
ACCEPTED_SUFFIXES = (SAFETENSORS_SUFFIX, *STATE_DICT_SUFFIXES, LIGHTNING_SUFFIX)
PROGRESS_MIN_BYTES = 64 * 2**20
"""With ``progress=True`` the bar is shown when the parameters total at least this many (fp32) bytes, or when
stderr is a terminal; small checkpoints in logs and tests stay quiet."""
# Trainer-state entries a consolidated ``.ckpt`` leaves out: optimizer and scheduler state (useless without the
# sharded layout and large) and what zero_strategy itself added.
_LEFT_OUT_OF_CKPT = ("optimizer_states", "lr_schedulers", BUFFERS_KEY, PARAM_GROUPS_KEY)


@dataclass(frozen=True, slots=True)
class StateDictEntry:
    """One key of the module's state_dict, in order."""

    key: str
    param: str | None  # canonical parameter name in the checkpoint; None for a buffer (or extra state)
    shape: list[int]  # parameters only; buffers carry their own shape


def consolidate(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    progress: bool = True,
    weights_only: bool = True,
) -> Path:
    """Write the full fp32 state_dict of the sharded ``checkpoint`` directory to ``output`` and return its path.

    ``checkpoint`` may also be a plain single file (a Lightning ``.ckpt`` or a torch state_dict): it is converted
    to ``output`` the same way, floating-point tensors in fp32. The format follows the suffix of ``output``:
    ``.safetensors`` (streamed, one tensor in memory at a time), ``.pt`` / ``.bin`` (a state_dict written by
    ``torch.save``) or ``.ckpt`` (a Lightning checkpoint without optimizer and scheduler state, for
    ``YourModule.load_from_checkpoint``). The file appears atomically
    (temporary name, then ``os.replace``). ``weights_only=False`` unpickles the trainer state in full: only for
    checkpoints you trust whose hyper-parameters hold objects. Raises :class:`CheckpointError` for a damaged or
    incomplete checkpoint and ``ValueError`` for an unsupported suffix.
    """
    target = Path(output)
    suffix = target.suffix.lower()
    if suffix not in ACCEPTED_SUFFIXES:
        raise ValueError(
            f"cannot tell the output format of {target}: its name must end in one of {', '.join(ACCEPTED_SUFFIXES)} "
            "(safetensors file, torch state_dict, Lightning checkpoint)"
        )
    if target.is_dir():
        raise ValueError(f"{target} is a directory; give the path of the file to write")
    if Path(checkpoint).is_file():  # a plain torch / Lightning checkpoint: convert it (see plain_file.py)
        state_dict, trainer_state = read_plain_checkpoint(Path(checkpoint), weights_only)
        _write_plain(state_dict, trainer_state, target)
        return target
    with open_for_export(checkpoint) as ckpt:
        entries = state_dict_entries(ckpt)
        state = TrainerState(ckpt, weights_only)
        bar = progress_bar(entries, progress)
        try:
            if suffix == SAFETENSORS_SUFFIX:
                _write_safetensors(ckpt, entries, state, target, bar.update)
            else:
                state_dict = dict(_values(ckpt, entries, state, bar.update))
                content = _lightning_checkpoint(ckpt, state, state_dict) if suffix == LIGHTNING_SUFFIX else state_dict
                _replace_atomically(target, lambda path: _torch_save_synced(content, path))
        finally:
            bar.close()
    return target


# ------------------------------------------------------------------------------------------------ reading
# what the exports read a checkpoint directory as
ExportSource = ShardedCheckpoint | TensorParallelView | DeepSpeedExportView


def open_for_export(checkpoint: str | os.PathLike) -> ExportSource:
    """Our sharded checkpoint directory, a tensor-parallel one as whole tensors, or a DeepSpeed ZeRO checkpoint
    directory read the same way."""
    path = Path(checkpoint)
    if is_tensor_parallel_directory(path):
        return TensorParallelView(path)
    if is_deepspeed_directory(path) and not (path / MANIFEST_NAME).is_file():
        return DeepSpeedExportView(path)
    return ShardedCheckpoint(path)


def state_dict_entries(ckpt: ExportSource) -> list[StateDictEntry]:
    """The module's state_dict keys in order, each with the checkpoint parameter behind it (tied keys share one)."""
    entries: list[StateDictEntry] = []
    for key, kind, name in ckpt.manifest.state_dict_keys:
        if kind == "param":
            if name not in ckpt.params:
                raise CheckpointError(
                    f"{ckpt.path}: state_dict key {key!r} is parameter {name!r}, which the manifest does not list"
                )
            entries.append(StateDictEntry(key, name, list(ckpt.params[name][1].shape)))
        else:
            entries.append(StateDictEntry(key, None, []))
    return entries


class TrainerState:
    """The trainer state, loaded on first use (a checkpoint without buffers needs it only for ``.ckpt``)."""

    def __init__(self, ckpt: ExportSource, weights_only: bool) -> None:
        self._ckpt = ckpt
        self._weights_only = weights_only
        self._state: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self._ckpt.trainer_state(self._weights_only)
        return self._state

    def buffer(self, key: str) -> Any:
        buffers = self.get().get(BUFFERS_KEY, {})
        if key not in buffers:
            raise CheckpointError(
                f"{self._ckpt.path}: buffer {key!r} of the module's state_dict is not in the trainer state"
            )
        return buffers[key]


def read_param_fp32(ckpt: ExportSource, name: str, on_bytes: Callable[[int], object] | None = None) -> Tensor:
    """Parameter ``name`` as one new fp32 tensor of its shape, filled chunk by chunk from whichever shards hold it
    (see [Note: streaming consolidation]); ``on_bytes`` is told how many output bytes each chunk produced."""
    param = ckpt.params[name][1]
    out = torch.empty(param.numel, dtype=torch.float32)
    chunk = max(1, READ_CHUNK_BYTES // out.element_size())
    for start in range(0, param.numel, chunk):
        count = min(chunk, param.numel - start)
        out[start : start + count].copy_(ckpt.read_param(name, "flat", start, count))
        if on_bytes is not None:
            on_bytes(count * out.element_size())
    return out.view(param.shape)


def _values(
    ckpt: ExportSource,
    entries: list[StateDictEntry],
    state: TrainerState,
    on_bytes: Callable[[int], object],
) -> Iterator[tuple[str, Any]]:
    """(key, value) in state_dict order for a dictionary built in memory: a tied parameter's later keys reuse the
    first tensor (as the module's own state_dict does) instead of reading it again. This keeps every tied tensor
    alive, so the streaming writers use :func:`stream_values` instead."""
    seen: dict[str, Tensor] = {}
    for entry in entries:
        if entry.param is None:
            yield entry.key, state.buffer(entry.key)
        elif entry.param in seen:
            on_bytes(seen[entry.param].numel() * 4)
            yield entry.key, seen[entry.param]
        else:
            value = read_param_fp32(ckpt, entry.param, on_bytes)
            seen[entry.param] = value
            yield entry.key, value


def stream_values(
    ckpt: ExportSource,
    entries: list[StateDictEntry],
    state: TrainerState,
    on_bytes: Callable[[int], object],
) -> Iterator[Any]:
    """The value of each entry in order, a tied parameter read again under each of its keys, and no reference kept
    here to a value once it was handed out: with a consumer that drops each value before asking for the next, one
    parameter is in memory at a time (see [Note: streaming consolidation])."""
    for entry in entries:
        # yielded without a local name: a variable of this frame would keep the previous parameter alive
        # while the next one is read
        yield state.buffer(entry.key) if entry.param is None else read_param_fp32(ckpt, entry.param, on_bytes)


# ------------------------------------------------------------------------------------------------ writing
def _write_safetensors(
    ckpt: ExportSource,
    entries: list[StateDictEntry],
    state: TrainerState,
    target: Path,
    on_bytes: Callable[[int], object],
) -> None:
    specs: list[tuple[str, torch.dtype, list[int]]] = []
    for entry in entries:
        if entry.param is not None:
            specs.append((entry.key, torch.float32, entry.shape))
            continue
        value = state.buffer(entry.key)
        if not isinstance(value, Tensor) or value.dtype not in DTYPE_CODES:
            kind = f"a {value.dtype} tensor" if isinstance(value, Tensor) else f"a {type(value).__name__}"
            raise ValueError(
                f"state_dict entry {entry.key!r} is {kind}, which a safetensors file cannot hold; "
                f"consolidate to {' or '.join(STATE_DICT_SUFFIXES)} instead"
            )
        specs.append((entry.key, value.dtype, list(value.shape)))
    tensors = stream_values(ckpt, entries, state, on_bytes)
    metadata = {"format": "pt", "zero_strategy_checkpoint_id": ckpt.manifest.checkpoint_id}
    _replace_atomically(target, lambda path: write_safetensors(path, specs, tensors, metadata))


def _write_plain(state_dict: dict[str, Any], trainer_state: dict[str, Any] | None, target: Path) -> None:
    """Write a plain checkpoint's tensors (already whole, in memory) in the format ``target``'s suffix names."""
    suffix = target.suffix.lower()
    if suffix == SAFETENSORS_SUFFIX:
        for key, value in state_dict.items():
            if not isinstance(value, Tensor) or value.dtype not in DTYPE_CODES:
                raise ValueError(
                    f"state_dict entry {key!r} is not a tensor safetensors can hold; consolidate to "
                    f"{' or '.join(STATE_DICT_SUFFIXES)} instead"
                )
        specs = [(key, value.dtype, list(value.shape)) for key, value in state_dict.items()]
        tensors = iter(state_dict.values())
        _replace_atomically(target, lambda path: write_safetensors(path, specs, tensors, {"format": "pt"}))
        return
    content: dict[str, Any] = state_dict
    if suffix == LIGHTNING_SUFFIX:
        content = {k: v for k, v in (trainer_state or {}).items() if k not in _LEFT_OUT_OF_CKPT}
        content.setdefault("pytorch-lightning_version", _installed_lightning())
        content["state_dict"] = state_dict
    _replace_atomically(target, lambda path: _torch_save_synced(content, path))


def _lightning_checkpoint(ckpt: ExportSource, state: TrainerState, state_dict: dict[str, Any]) -> dict:
    """Lightning's trainer state (epoch, global_step, loops, hyper-parameters, ...) with the full state_dict."""
    content = {k: v for k, v in state.get().items() if k not in _LEFT_OUT_OF_CKPT}
    if "pytorch-lightning_version" not in content:  # a checkpoint written by the core API, not by a Trainer
        content["pytorch-lightning_version"] = ckpt.manifest.versions.get("lightning") or _installed_lightning()
    content["state_dict"] = state_dict
    return content


def _installed_lightning() -> str:
    # Read from the package metadata: this folder does not import Lightning (see __init__.py).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning")
    except PackageNotFoundError:
        raise ValueError(
            "a .ckpt output records the Lightning version that reads it, and neither the checkpoint nor this "
            "environment has one; install lightning or consolidate to .safetensors / .pt"
        ) from None


def _torch_save_synced(content: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(content, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _replace_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """Have ``write`` fill a hidden temporary file next to ``target`` (and fsync it), then rename it to
    ``target``: readers see the previous file or the complete new one, and a failure leaves no stray file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


# ------------------------------------------------------------------------------------------------ progress
class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(entries: list[StateDictEntry], progress: bool) -> Any:
    """A tqdm bar over the parameters' fp32 bytes (see PROGRESS_MIN_BYTES), or a silent stand-in."""
    total = 0
    for entry in entries:
        if entry.param is not None:
            numel = 1
            for dim in entry.shape:
                numel *= dim
            total += 4 * numel
    if not progress or (total < PROGRESS_MIN_BYTES and not sys.stderr.isatty()):
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="zero-to-fp32", file=sys.stderr)
