"""Pretrained weights, read by name and element range: what ``load_pretrained`` and sharded construction build on.

``open_pretrained(PATH)`` accepts a ``.safetensors`` file, a Hugging Face sharded checkpoint (a directory or its
``*.index.json``), a directory holding ``model.safetensors`` / ``pytorch_model.bin``, this project's sharded
checkpoint directory or its consolidated outputs, a ``torch.distributed.checkpoint`` directory (FSDP2,
torchtitan, Lightning's sharded checkpoints, ``zero-to-dcp``), a DeepSpeed ZeRO checkpoint directory (any stage;
checkpoint/deepspeed/), and a plain ``.pt`` / ``.pth`` / ``.bin`` /
``.ckpt`` torch file (memory-mapped, ``weights_only=True``); a file of any other name is recognised by its
content. ``source.read(name, start, count)`` returns elements ``[start, start + count)`` of the tensor's
row-major flattening, in fp32 unless another dtype is asked for, reading only those elements from disk (see
[Note: pretrained reads stay small] in checkpoint/pretrained/stores.py). A rank that owns a slice of a flat
parameter reads exactly that slice; nothing holds a whole file or model.

Importable without Lightning, like the rest of this folder.
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, CheckpointError
from zero_strategy.checkpoint.base.safetensors_io import READ_CHUNK_BYTES
from zero_strategy.checkpoint.dcp.paths import METADATA_NAME as DCP_METADATA_NAME
from zero_strategy.checkpoint.dcp.paths import is_dcp_directory
from zero_strategy.checkpoint.deepspeed.layout import is_deepspeed_directory
from zero_strategy.checkpoint.pretrained.keys import (
    KeyMap,
    KeyMatch,
    alias_groups,
    expected_shapes,
    match_keys,
    renamed_keys,
)
from zero_strategy.checkpoint.pretrained.stores import (
    IndexStore,
    ShardedCheckpointStore,
    TensorStore,
    open_tensor_file,
)
from zero_strategy.checkpoint.sharded.tensor_parallel import is_tensor_parallel_directory

INDEX_SUFFIX = ".index.json"
DIRECTORY_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
"""What a directory that is not a sharded checkpoint is searched for, in this order (safetensors before pickle-
based files, as Hugging Face does)."""
ACCEPTED = (
    "a .safetensors file; a Hugging Face sharded checkpoint (a directory or its *.index.json); a directory "
    "holding model.safetensors or pytorch_model.bin; a zero_strategy sharded checkpoint directory (manifest.json) "
    "or a file zero-to-fp32 wrote; a torch.distributed.checkpoint directory (.metadata); a DeepSpeed ZeRO "
    "checkpoint directory (holding its 'latest' file, or a tag directory); a torch state_dict or "
    "Lightning checkpoint (.pt, .pth, .bin, .ckpt, or any name: recognised by content)"
)


class PretrainedSource:
    """Tensors of a pretrained checkpoint under the module's names (the file's keys after ``key_map``).

    ``read`` checks the range against the tensor's shape and converts to the requested dtype; a conversion to a
    wider float (bf16/fp16 → fp32) is exact. Close it (or use ``with``) to release file handles and mappings."""

    def __init__(self, store: TensorStore, key_map: KeyMap = None) -> None:
        self._store = store
        try:
            self._file_key = renamed_keys(store.keys(), key_map, str(store.path))
        except BaseException:
            store.close()
            raise

    @property
    def path(self) -> Path:
        return self._store.path

    def keys(self) -> list[str]:
        return list(self._file_key)

    def __contains__(self, name: object) -> bool:
        return name in self._file_key

    def __len__(self) -> int:
        return len(self._file_key)

    def file_key(self, name: str) -> str:
        """The key ``name`` has in the file (before ``key_map``)."""
        if name not in self._file_key:
            shown = ", ".join(list(self._file_key)[:5])
            raise KeyError(f"{self.path} has no tensor named {name!r} (after key_map); its names begin: {shown}")
        return self._file_key[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._store.shape(self.file_key(name))

    def dtype(self, name: str) -> torch.dtype:
        """The dtype stored in the file."""
        return self._store.dtype(self.file_key(name))

    def numel(self, name: str) -> int:
        numel = 1
        for dim in self.shape(name):
            numel *= dim
        return numel

    def read(
        self, name: str, start: int = 0, count: int | None = None, dtype: torch.dtype | None = torch.float32
    ) -> Tensor:
        """Elements ``[start, start + count)`` (to the end when ``count`` is None) of tensor ``name``'s row-major
        flattening, as a new 1-D CPU tensor of ``dtype`` (``None``: the stored dtype)."""
        key, numel = self.file_key(name), self.numel(name)
        count = numel - start if count is None else count
        if not (0 <= start and 0 <= count and start + count <= numel):
            raise ValueError(
                f"elements [{start}, {start + count}) are outside tensor {name!r} of {self.path}, which has {numel} "
                f"(shape {list(self.shape(name))})"
            )
        values = self._store.read(key, start, count)
        return values if dtype is None or values.dtype == dtype else values.to(dtype)

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> PretrainedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_pretrained(path: str | os.PathLike, key_map: KeyMap = None) -> PretrainedSource:
    """Open the pretrained weights at ``path`` (any kind listed in the module docstring), with the file's keys
    renamed by ``key_map`` (see [Note: key_map] in checkpoint/pretrained/keys.py). Raises :class:`CheckpointError`
    naming the file for anything that is not readable weights."""
    return PretrainedSource(_open_store(Path(path)), key_map)


def _open_store(path: Path) -> TensorStore:
    if not path.exists():
        raise CheckpointError(f"pretrained weights {path} do not exist (accepted: {ACCEPTED})")
    if path.is_dir():
        if (path / MANIFEST_NAME).is_file() or is_tensor_parallel_directory(path):
            return ShardedCheckpointStore(path)
        if is_deepspeed_directory(path):
            from zero_strategy.checkpoint.pretrained.deepspeed_store import DeepSpeedStore

            return DeepSpeedStore(path)
        if is_dcp_directory(path):
            from zero_strategy.checkpoint.pretrained.dcp_store import (
                DcpStore,  # torch's DCP modules load only when used
            )

            return DcpStore(path)
        for name in DIRECTORY_FILES:
            if (path / name).is_file():
                return _open_file(path / name)
        held = sorted(entry.name for entry in path.iterdir())
        raise CheckpointError(
            f"{path} is a directory with none of {MANIFEST_NAME}, {DCP_METADATA_NAME}, {', '.join(DIRECTORY_FILES)} "
            "(it holds "
            f"{held[:10]}{' ...' if len(held) > 10 else ''}); give the weights file itself, or one of: {ACCEPTED}"
        )
    return _open_file(path)


def _open_file(path: Path) -> TensorStore:
    name = path.name.lower()
    if name.endswith(INDEX_SUFFIX):
        return IndexStore(path)
    return open_tensor_file(path)  # a known suffix, or what the content says (any torch.save output)


# ------------------------------------------------------------------------------------------------ modules
def load_pretrained_into_module(
    module: nn.Module, path: str | os.PathLike, strict: bool = True, key_map: KeyMap = None
) -> KeyMatch:
    """Copy the pretrained weights at ``path`` into an ordinary module (real tensors, not meta, not sharded),
    tensor by tensor and chunk by chunk, so memory beyond the module stays at one chunk. Keys are matched as
    :func:`match_keys` does (one error listing every problem; tied weights load from whichever name the file
    holds); frozen parameters and persistent buffers load too. Returns the match (``missing`` lists what
    ``strict=False`` left untouched)."""
    state = {key: value for key, value in module.state_dict(keep_vars=True).items() if isinstance(value, Tensor)}
    on_meta = [key for key, value in state.items() if value.is_meta]
    if on_meta:
        shown = ", ".join(on_meta[:5]) + (" ..." if len(on_meta) > 5 else "")
        raise ValueError(
            f"the module has tensors on the meta device ({shown}); "
            "load_pretrained_into_module fills real tensors: materialize the module first (module.to_empty(...)), "
            "or let the ZeRO strategy load it shard by shard"
        )
    with open_pretrained(path, key_map) as source:
        match = match_keys(source, expected_shapes(module), strict, alias_groups(module), where=str(source.path))
        filled: set[int] = set()
        with torch.no_grad():
            for name, source_name in match.sources.items():
                target = state[name]
                if id(target) in filled:  # a tied alias: one tensor, loaded once
                    continue
                _copy_into(source, source_name, target)
                filled.add(id(target))
    return match


def _copy_into(source: PretrainedSource, name: str, target: Tensor) -> None:
    numel = target.numel()
    if not target.is_contiguous():  # rare (a parameter made from a transpose): one whole-tensor read
        target.copy_(source.read(name, dtype=target.dtype).view(target.shape))
        return
    flat = target.view(-1)
    chunk = max(1, READ_CHUNK_BYTES // target.element_size())
    for start in range(0, numel, chunk):
        count = min(chunk, numel - start)
        flat[start : start + count].copy_(source.read(name, start, count, dtype=target.dtype))


# ------------------------------------------------------------------------------------------ the public call
@dataclass(frozen=True, slots=True)
class PendingLoad:
    """A ``load_pretrained`` on a module that has no values yet (meta-built): done when ZeRO shards it."""

    path: str
    strict: bool
    key_map: KeyMap


_PENDING: weakref.WeakKeyDictionary[nn.Module, PendingLoad] = weakref.WeakKeyDictionary()


def load_pretrained(
    module: nn.Module, path: str | os.PathLike, strict: bool = True, key_map: KeyMap = None
) -> KeyMatch | None:
    """Load pretrained weights into ``module`` (keys relative to it; ``key_map`` renames the file's keys).

    Called in ``configure_model`` on a module built there (meta tensors under a ZeRO strategy), it checks the
    keys now — one error listing every missing, unexpected and shape-mismatched key — and the ZeRO strategy
    loads the weights when it shards the model, each rank reading only the element ranges it keeps (returns
    None). On an ordinary module it copies the weights tensor by tensor (returns the match)."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return load_pretrained_into_module(module, path, strict, key_map)
    with open_pretrained(path, key_map) as source:  # fail now, not at setup, on a bad file or bad keys
        match_keys(source, expected_shapes(module), strict, alias_groups(module), where=str(source.path))
    _PENDING[module] = PendingLoad(str(path), strict, key_map)
    return None


def pending_loads(root: nn.Module) -> list[tuple[str, PendingLoad]]:
    """(qualified name under ``root``, pending load) for ``root`` and each submodule with one, outermost first."""
    return [(name, _PENDING[sub]) for name, sub in root.named_modules() if sub in _PENDING]


def forget_pending(root: nn.Module) -> None:
    for _, sub in root.named_modules():
        _PENDING.pop(sub, None)
