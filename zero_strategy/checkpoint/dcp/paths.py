"""File names inside a ``torch.distributed.checkpoint`` directory. Kept apart from the DCP code so that recognising
such a directory does not import torch's DCP modules (``import zero_strategy`` stays light)."""

from __future__ import annotations

from pathlib import Path

METADATA_NAME = ".metadata"  # torch's name for a DCP directory's index (a pickled Metadata)
DATA_SUFFIX = ".distcp"
LIGHTNING_META_NAME = "meta.pt"  # Lightning's FSDP/ModelParallel strategies keep their trainer state here


def is_dcp_directory(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_NAME).is_file()


def data_file_name(save_id: str, rank: int) -> str:
    """A rank's data file of one save: the save's id in the name keeps it apart from earlier saves' files."""
    return f"__{save_id}_{rank}{DATA_SUFFIX}"
