"""``zero-to-fp32 CHECKPOINT --hf OUT_DIR``: a sharded checkpoint becomes a Hugging Face model directory that
``AutoModel.from_pretrained(OUT_DIR)`` (or ``AutoModelForCausalLM`` ...) loads.

The directory holds ``config.json`` (the user's, copied) and either ``model.safetensors`` or, above the shard size,
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
"weight_map": {name: file}}``, the layout transformers reads). Parameters are fp32, buffers keep their dtype, names
come from the module's state_dict keys through a key map, and a tied parameter is written once (see [Note: Hugging
Face tied weights] in hf_layout.py). Tensors are streamed one at a time into the files, as consolidation streams
(see [Note: streaming consolidation] in checkpoint/export/consolidate.py): memory follows the largest tensor, not the
model. The directory is built under a hidden temporary name next to OUT_DIR and renamed into place when complete.

The names written are checked against the model the config builds (see [Note: checking the names against the
config's model] in checkpoint/export/hf_names.py): a name no parameter of it has would load as nothing.

The config is required, not optional with a warning: a directory without config.json cannot be loaded by
``from_pretrained`` at all, and the export exists to be loaded; the weights alone are ``zero-to-fp32 CKPT
model.safetensors``.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zero_strategy.checkpoint.base.format import fsync_directory
from zero_strategy.checkpoint.base.safetensors_io import DTYPE_CODES, write_safetensors
from zero_strategy.checkpoint.export.consolidate import (
    StateDictEntry,
    TrainerState,
    open_for_export,
    progress_bar,
    state_dict_entries,
    stream_values,
)
from zero_strategy.checkpoint.export.hf_layout import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    ConfigSource,
    HfExportError,
    KeyMap,
    KeyMapping,
    config_text,
    keep_tied_aliases,
    output_names,
    parse_size,
    plan_shards,
    shard_names,
)
from zero_strategy.checkpoint.export.hf_names import Note, fitted_key_map

__all__ = ["HfExportError", "KeyMap", "consolidate_hf"]  # what a user imports from here


@dataclass(frozen=True, slots=True)
class _Written:
    """One tensor of the directory: where it comes from and what it is called there."""

    entry: StateDictEntry
    name: str
    dtype: torch.dtype
    shape: list[int]

    @property
    def numel(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def consolidate_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: ConfigSource | None,
    *,
    key_map: KeyMapping | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    progress: bool = True,
    weights_only: bool = True,
    check_names: bool = True,
    note: Note | None = None,
) -> Path:
    """Write the sharded ``checkpoint`` directory as a Hugging Face model directory ``out_dir`` and return its path.

    ``config``: the model's ``PretrainedConfig`` (``model.config``), a dict, or the path of a config.json or of its
    directory; copied as ``config.json``. ``key_map``: a :class:`~zero_strategy.checkpoint.export.hf_layout.KeyMap`
    (e.g. ``KeyMap(strip_prefix="model.")`` for a LightningModule holding the model as ``self.model``) or a function
    from state_dict key to name (None leaves the key out). ``max_shard_size``: bytes or ``"5GB"``-style; a larger
    model is split into several files and an index. ``out_dir`` must not exist or be empty. ``check_names``: check
    the names against the model the config builds, and strip the one prefix that makes them fit when no prefix to
    strip was given (see [Note: checking the names against the config's model]); ``note``: where what the check
    says goes (default: a warning). Raises
    :class:`HfExportError` (a ``ValueError``) for a bad input, before anything is written, and
    :class:`~zero_strategy.checkpoint.base.format.CheckpointError` for a damaged checkpoint.
    """
    target = Path(out_dir)
    _check_target(target)
    max_bytes = parse_size(max_shard_size)
    text, content = config_text(config)
    if Path(checkpoint).is_file():
        raise HfExportError(
            f"{checkpoint} is a file; --hf reads a zero_strategy sharded checkpoint directory. For a plain "
            "Lightning / torch checkpoint, load its state_dict into the Hugging Face model and call save_pretrained"
        )
    with open_for_export(checkpoint) as ckpt:
        state = TrainerState(ckpt, weights_only)
        entries = state_dict_entries(ckpt)
        keys = [entry.key for entry in entries]
        output_names(keys, key_map)  # the key map's own errors first
        if check_names:
            key_map = fitted_key_map(keys, key_map, content, note or _warn)
        written = _written_tensors(entries, state, key_map, keep_tied_aliases(content))
        counts = plan_shards([tensor.nbytes for tensor in written], max_bytes)
        metadata = {"format": "pt", "zero_strategy_checkpoint_id": ckpt.manifest.checkpoint_id}
        entries = [tensor.entry for tensor in written]
        bar = progress_bar(entries, progress)
        tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            values = stream_values(ckpt, entries, state, bar.update)
            _write_shards(tmp, written, counts, values, metadata)
            _write_text(tmp / CONFIG_NAME, text)
            fsync_directory(tmp)
            os.replace(tmp, target)  # POSIX rename: replaces an empty directory, fails on a non-empty one
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
    fsync_directory(target.parent)
    return target


def _warn(message: str) -> None:
    warnings.warn(f"zero-to-fp32 --hf: {message}", stacklevel=3)


def _check_target(target: Path) -> None:
    if target.is_dir() and any(target.iterdir()):
        raise HfExportError(
            f"{target} already exists and is not empty; an export writes a new directory (it never mixes with "
            "another model's files): remove it or give another path"
        )
    if target.exists() and not target.is_dir():
        raise HfExportError(f"{target} is a file; give the path of the directory to create")


def _written_tensors(
    entries: list[StateDictEntry], state: TrainerState, key_map: KeyMapping | None, keep_aliases: bool
) -> list[_Written]:
    """The tensors of the directory in state_dict order: keys the key map keeps, one key per tied parameter unless
    ``keep_aliases`` (see [Note: Hugging Face tied weights]), every buffer checked to be a safetensors tensor."""
    names = output_names([entry.key for entry in entries], key_map)
    written: list[_Written] = []
    params_seen: set[str] = set()
    for entry in entries:
        if entry.key not in names:
            continue
        if entry.param is not None:
            if entry.param in params_seen and not keep_aliases:
                continue
            params_seen.add(entry.param)
            written.append(_Written(entry, names[entry.key], torch.float32, entry.shape))
            continue
        value = state.buffer(entry.key)
        if not isinstance(value, Tensor) or value.dtype not in DTYPE_CODES:
            kind = f"a {value.dtype} tensor" if isinstance(value, Tensor) else f"a {type(value).__name__}"
            raise HfExportError(
                f"state_dict entry {entry.key!r} is {kind}, which a safetensors file cannot hold; leave it out "
                "with the key map (--drop PREFIX)"
            )
        written.append(_Written(entry, names[entry.key], value.dtype, list(value.shape)))
    return written


def _write_shards(
    directory: Path, written: list[_Written], counts: list[int], values: Iterator[Any], metadata: dict[str, str]
) -> None:
    """Fill each file with its run of tensors pulled from ``values``; with several files, write the index."""
    files = shard_names(len(counts))
    weight_map: dict[str, str] = {}
    start = 0
    for file, count in zip(files, counts, strict=True):
        run = written[start : start + count]
        specs = [(tensor.name, tensor.dtype, tensor.shape) for tensor in run]
        write_safetensors(directory / file, specs, islice(values, count), metadata)
        weight_map.update((tensor.name, file) for tensor in run)
        start += count
    if len(files) > 1:
        index = {
            "metadata": {
                "total_size": sum(tensor.nbytes for tensor in written),
                "total_parameters": sum(tensor.numel for tensor in written if tensor.entry.param is not None),
            },
            "weight_map": weight_map,
        }
        _write_text(directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
