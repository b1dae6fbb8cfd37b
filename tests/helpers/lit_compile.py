"""A LightningModule that builds its network in ``configure_model`` and compiles it there, the way the README
recommends (``how="blocks"``: each block's ``compile()``) or the plain way (``how="whole"``:
``self.net = torch.compile(net)``), for tests/lightning/test_compile_trainer.py.

Each rank writes its final weights (``_orig_mod.`` removed from the names, so compiled and eager runs compare
key by key) and what dynamo did: frames compiled before each training step, and graph breaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch._dynamo.utils import counters

from helpers.lit import LR
from helpers.models import TiedLM, lm_loss


def dynamo_report() -> dict[str, Any]:
    """Frames dynamo compiled (a recompilation counts again), graphs it produced, and graph breaks by reason."""
    return {
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


class CompiledLM(pl.LightningModule):
    def __init__(self, out_dir: str, how: str, backend: str = "inductor") -> None:
        super().__init__()
        self.backend = backend
        self.net: torch.nn.Module | None = None
        self.out_dir, self.how = out_dir, how
        self.frames_before_step: list[int] = []

    def configure_model(self) -> None:
        if self.net is not None:  # configure_model runs again on a later fit/test
            return
        net = TiedLM()
        if self.how == "blocks":
            for block in net.blocks:
                block.compile(backend=self.backend)
        self.net = torch.compile(net, backend=self.backend) if self.how == "whole" else net

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.frames_before_step.append(counters["frames"]["total"])
        _, tokens = batch
        assert self.net is not None
        return lm_loss(self.net, tokens)

    def on_fit_end(self) -> None:
        # after the strategy's teardown: full parameters again (the test asks for them: full_params_after_fit=True)
        state = {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in self.state_dict().items()}
        report = {**dynamo_report(), "frames_before_step": self.frames_before_step}
        torch.save({"state": state, "dynamo": report}, Path(self.out_dir) / f"compiled_rank{self.global_rank}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
