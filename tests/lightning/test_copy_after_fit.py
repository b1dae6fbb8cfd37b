"""After a fit, the callbacks (and through Lightning's progress bar, which keeps the Trainer, the strategy and the
module) deep-copy and pickle as after a DDP fit, at every stage, stage 3 on both transports, on 1 and 2 processes; a
fit resumed from a checkpoint too (an opened checkpoint holds files). The copies hold the trained weights: DDP's
values (see [Note: a copy of the strategy holds no engine] in zero_strategy/lightning/sharded_model.py)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from helpers.lit import loader
from helpers.lit_patterns import Patterns
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": lambda: "zero1",
    "zero2": lambda: "zero2",
    "zero3": lambda: ZeroStrategy(stage=3, collectives="auto"),
    "zero3_point_to_point": lambda: ZeroStrategy(stage=3, collectives="point_to_point"),
}


def _weights_seen_by(callbacks: list[pl.Callback]) -> dict[str, torch.Tensor]:
    """The module's weights as a copy of the callbacks reaches them: through the progress bar's Trainer."""
    bar = next(callback for callback in callbacks if isinstance(callback, ProgressBar))
    return {k: v.detach().clone() for k, v in bar.trainer.lightning_module.state_dict().items()}


def _copies(trainer: pl.Trainer) -> dict[str, Any]:
    out: dict[str, Any] = {"original": _weights_seen_by(trainer.callbacks)}
    out["deepcopy"] = _weights_seen_by(copy.deepcopy(trainer.callbacks))
    out["pickle"] = _weights_seen_by(pickle.loads(pickle.dumps(trainer.callbacks)))
    return out


def fit_and_copy(rank: int, world: int, root: str) -> dict[str, Any]:
    """DDP then each ZeRO strategy: a fit, then a fit resumed from its checkpoint; copies after each."""
    as_launched_rank(rank, world)
    out = {}
    for name, make in {"ddp": lambda: "ddp", **STRATEGIES}.items():
        pl.seed_everything(0, verbose=False)
        module = Patterns()
        settings: dict[str, Any] = dict(accelerator="cpu", devices=world, logger=False, enable_progress_bar=True,
                                        default_root_dir=f"{root}/{name}", enable_model_summary=False)
        trainer = pl.Trainer(strategy=make(), max_steps=2, **settings)
        trainer.fit(module, loader(4 * 4 * world, 21))
        after_fit = _copies(trainer)
        checkpoint = f"{root}/{name}.ckpt"
        trainer.save_checkpoint(checkpoint)
        resumed = pl.Trainer(strategy=make(), max_steps=4, **settings)
        resumed.fit(module, loader(4 * 4 * world, 21), ckpt_path=checkpoint)
        out[name] = {"fit": after_fit, "resumed": _copies(resumed)}
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root: Path = tmp_path_factory.mktemp(f"copy_after_fit_{request.param}")
    return run_ranks(fit_and_copy, request.param, str(root), timeout_s=400)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_callbacks_copy_and_pickle_after_fit_as_under_ddp(runs: list[dict], strategy: str) -> None:
    for rank, result in enumerate(runs):
        for run in ("fit", "resumed"):
            ddp = result["ddp"][run]["original"]
            assert ddp.keys() == result[strategy][run]["original"].keys()
            for how in ("original", "deepcopy", "pickle"):
                got = result[strategy][run][how]
                for key, value in ddp.items():
                    torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6,
                                               msg=lambda m, k=key, h=how, r=run, n=rank: f"rank {n} {r} {h} {k}: {m}")
