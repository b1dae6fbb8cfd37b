"""Finding the files of a DeepSpeed checkpoint, and refusing the layouts this package does not read.

[Note: DeepSpeed's directory layouts]
``engine.save_checkpoint(DIR)`` writes ``DIR/latest`` (the tag, ``global_step<N>`` by default) and ``DIR/<tag>/``
holding ``mp_rank_00_model_states.pt`` (module values, parameter names and shapes by param group, tied and frozen
parameters, the LR scheduler, step counters, the caller's client state) and one ``zero_pp_rank_<r>_mp_rank_00_
optim_states.pt`` per data-parallel rank (its fp32 partition and optimizer state; ``bf16_`` in front when
DeepSpeed's bf16 optimizer wrote it). Stage 3 adds ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (its
fragments of frozen parameters). Lightning's ``DeepSpeedStrategy`` saves ``X.ckpt`` as such a ``DIR`` with the tag
``checkpoint``, its own trainer state in the client state. ``ds_to_universal`` writes ``DIR/<tag>_universal/``
(named by ``DIR/latest_universal``) with ``zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt``: whole tensors.
A directory may be given at any of these levels: ``DIR``, ``DIR/<tag>``, or Lightning's ``X.ckpt``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from zero_strategy.checkpoint.base.format import CheckpointError

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
STAGE3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # stage 3 writes no MODEL_STATES
UNIVERSAL_PARAMS = "zero"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_RANK_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_OTHER_MP = re.compile(r"mp_rank_(?!00)\d+")
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
_EXPERT = re.compile(r"^(expp_rank_|.*expert_)")
SUPPORTED = (
    "DeepSpeed ZeRO stage 1, 2 or 3 checkpoints of one model-parallel rank (mp_rank_00) without pipeline "
    "parallelism or experts: the plain engine layout, Lightning's DeepSpeedStrategy directory, or the universal "
    "layout ds_to_universal writes"
)


@dataclass(frozen=True, slots=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint (see [Note: DeepSpeed's directory layouts])."""

    root: Path  # the directory the user named
    tag_dir: Path  # where the model-states file sits
    model_states: Path
    optim_states: list[Path]  # by data-parallel rank (empty for the universal layout)
    rank_model_states: list[Path]  # stage 3's per-rank model files, by rank (empty otherwise)
    universal: bool


def _holds_model_states(path: Path) -> bool:
    return (path / MODEL_STATES).is_file() or (path / STAGE3_MODEL_STATES).is_file()


def _tag_dir(path: Path) -> tuple[Path, bool] | None:
    """The tag directory under ``path`` (and whether it is a universal one), or None if ``path`` is not one."""
    if _holds_model_states(path):
        return path, (path / UNIVERSAL_PARAMS).is_dir()
    for pointer, universal in ((LATEST, False), (LATEST_UNIVERSAL, True)):
        if (path / pointer).is_file():
            tag = (path / pointer).read_text().strip()
            if tag and _holds_model_states(path / tag):
                return path / tag, universal or (path / tag / UNIVERSAL_PARAMS).is_dir()
    return None


def is_deepspeed_directory(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory at one of the levels the layout note names."""
    return path.is_dir() and _tag_dir(path) is not None


def find_files(path: Path) -> DeepSpeedFiles:
    """The files of the DeepSpeed checkpoint at ``path``; :class:`CheckpointError` for anything else, or for a
    layout outside :data:`SUPPORTED` (naming what was found)."""
    found = _tag_dir(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"{path} is not a DeepSpeed checkpoint directory: no {MODEL_STATES}, and no '{LATEST}' / "
            f"'{LATEST_UNIVERSAL}' file naming a directory that holds one"
        )
    tag_dir, universal = found
    names = sorted(entry.name for entry in tag_dir.iterdir())
    _refuse_unsupported(tag_dir, names)
    model_states = tag_dir / (MODEL_STATES if (tag_dir / MODEL_STATES).is_file() else STAGE3_MODEL_STATES)
    if universal:
        return DeepSpeedFiles(path, tag_dir, model_states, [], [], True)
    optim = _by_rank(tag_dir, names, _OPTIM, group=2)
    if not optim:
        raise CheckpointError(
            f"{tag_dir} holds no zero_pp_rank_<r>_mp_rank_00_optim_states.pt files: not a ZeRO checkpoint (a "
            f"checkpoint without ZeRO, stage 0, is not read; supported: {SUPPORTED})"
        )
    rank_model = _by_rank(tag_dir, names, _RANK_MODEL, group=1)
    if rank_model and len(rank_model) != len(optim):
        raise CheckpointError(f"{tag_dir}: {len(optim)} optimizer-state files but {len(rank_model)} model-state files")
    return DeepSpeedFiles(path, tag_dir, model_states, optim, rank_model, False)


def _by_rank(tag_dir: Path, names: list[str], pattern: re.Pattern[str], group: int) -> list[Path]:
    ranked = {int(match.group(group)): tag_dir / name for name in names if (match := pattern.match(name))}
    if ranked and sorted(ranked) != list(range(len(ranked))):
        missing = sorted(set(range(max(ranked) + 1)) - set(ranked))
        raise CheckpointError(
            f"{tag_dir}: the files of ranks {missing} are missing (found ranks {sorted(ranked)}): an incomplete save"
        )
    return [ranked[rank] for rank in sorted(ranked)]


def _refuse_unsupported(tag_dir: Path, names: list[str]) -> None:
    kinds = [
        ("tensor-parallel files (a model-parallel rank other than mp_rank_00)",
         [n for n in names if _OTHER_MP.search(n)]),
        ("pipeline-parallel layer files", [n for n in names if _PIPELINE.match(n)]),
        ("expert (MoE) files", [n for n in names if _EXPERT.match(n)]),
    ]
    for what, found in kinds:
        if found:
            raise CheckpointError(
                f"{tag_dir} holds {what}: {found[:4]}{' ...' if len(found) > 4 else ''}. This is not read; supported: "
                f"{SUPPORTED}. Convert it with DeepSpeed first (e.g. its zero_to_fp32 for the weights)."
            )
