"""The DeepSpeed fixtures of tests/checkpoint/deepspeed_fixtures/ (made by DeepSpeed itself: see README.md there) and
small writers of DeepSpeed-shaped files for the refusal and memory tests. Nothing here imports DeepSpeed."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"


@cache
def record() -> dict[str, Any]:
    """What DeepSpeed did with each fixture (make_fixtures.py's record.json)."""
    return dict(json.loads((FIXTURES / "record.json").read_text()))


def fixture_names(layout: str | None = None) -> list[str]:
    return sorted(name for name, entry in record()["fixtures"].items() if layout in (None, entry["layout"]))


def fixture(name: str) -> dict[str, Any]:
    return dict(record()["fixtures"][name])


def checkpoint_dir(name: str) -> Path:
    return FIXTURES / fixture(name)["checkpoint"]


def zero_to_fp32(name: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own zero_to_fp32 output for the fixture's checkpoint."""
    return dict(torch.load(FIXTURES / fixture(name)["zero_to_fp32"], map_location="cpu", weights_only=True))


def write_layout(root: Path, model_states: dict[str, Any], optim_states: list[dict[str, Any]],
                 tag: str = "global_step1", prefix: str = "") -> Path:
    """``root`` laid out as DeepSpeed's engine saves (``latest`` naming ``tag``), with the given contents."""
    (root / tag).mkdir(parents=True, exist_ok=True)
    (root / "latest").write_text(tag)
    torch.save(model_states, root / tag / "mp_rank_00_model_states.pt")
    for rank, content in enumerate(optim_states):
        torch.save(content, root / tag / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return root
