"""LightningModules that read ``p.grad`` where real training code does, recording what they saw per rank, so that a
test compares ZeRO with DDP doing the same (tests/lightning/test_grad_reads_trainer.py)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm, rank_zero_only
from torch import Tensor

from helpers.models import TiedLM, lm_loss

MAX_NORM = 0.05  # below the gradients' norm: clipping by hand changes what the step uses


def grads_of(module: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter's ``p.grad`` as the user reads it (a parameter without one is left out)."""
    return {name: p.grad.detach().float().clone() for name, p in module.named_parameters() if p.grad is not None}


class ReadsGradients(pl.LightningModule):
    """Automatic optimization with accumulation over 2 micro-batches and validation inside a window; reads p.grad
    in on_after_backward, on_before_optimizer_step (Lightning's grad_norm), configure_gradient_clipping (torch's
    clip_grad_norm_ over self.parameters()) and after validation."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.seen: dict[str, list[Any]] = {"after_backward": [], "norms": [], "clip": [], "after_validation": []}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return lm_loss(self.net, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.net, batch[1]), sync_dist=True)

    def on_after_backward(self) -> None:
        self.seen["after_backward"].append(grads_of(self))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen["norms"].append({k: v.detach().float().clone() for k, v in grad_norm(self, norm_type=2).items()})

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        total = torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)
        self.seen["clip"].append({"norm": total.detach().float().clone(), **grads_of(self)})

    def on_validation_end(self) -> None:  # inside an accumulation window: the gradients held so far are intact
        self.seen["after_validation"].append(grads_of(self))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class RankZeroGradientLogger(pl.Callback):
    """Reads p.grad on rank 0 only (the common logging pattern): under ZeRO no rank may wait for an exchange."""

    def __init__(self) -> None:
        self.norms: list[Tensor] = []

    @rank_zero_only
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad.detach().float().reshape(-1) for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.cat(grads).norm().clone())


class ManualGradients(pl.LightningModule):
    """Manual optimization: after manual_backward, p.grad is read, summed by hand and clipped with torch's
    clip_grad_norm_ before opt.step()."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.automatic_optimization = False
        self.seen: dict[str, list[Any]] = {"sums": [], "after_step": []}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(lm_loss(self.net, batch[1]))
        assert all(p.grad is not None for p in self.parameters()), "a used parameter has no gradient"
        self.seen["sums"].append(torch.stack([p.grad.double().sum() for p in self.parameters()]).clone())
        torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)
        opt.step()
        self.seen["after_step"].append(grads_of(self))  # DDP keeps them until zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ComparesNorms(pl.LightningModule):
    """Records, in on_before_optimizer_step, Lightning's grad_norm over p.grad and zero_strategy.grad_norm over the
    slices: under fp16 both must be unscaled there, as Lightning's DDP unscales before the hook."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=2)
        self.pairs: list[tuple[dict[str, float], dict[str, float]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return lm_loss(self.net, batch[1])

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        import zero_strategy

        ours = {k: float(v) for k, v in zero_strategy.grad_norm(self, 2).items()}
        self.pairs.append(({k: float(v) for k, v in grad_norm(self, 2).items()}, ours))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
