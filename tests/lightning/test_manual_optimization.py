"""Manual optimization with two optimizers and both kinds of clipping, against DDP.

The generator's loss backpropagates through the discriminator, so after its backward D's parameters hold
gradients too; ``opt_d.zero_grad()`` must drop them (at stage 1 they are still on the module, at stages 2/3 on
D's slices). ``self.clip_gradients`` receives Lightning's wrapper and runs between ``manual_backward`` and
``opt.step()``: at stage 1 the gradients must be reduced there (once), and the norm is the global one.

One ``run_ranks`` launch (2 ranks, each fitting as a rank torchrun started) fits DDP, then stages 1, 2 and 3 in
turn, and the tests compare every rank's final weights with DDP's.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.launched import as_launched_rank
from helpers.lit import NoiseAndReal, state_of, trainer_kwargs
from helpers.models import assert_state_close
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

CLIP_NORM = 0.05  # below every pre-clip norm of the generator's gradients (asserted on the DDP run)
CLIP_VALUE = 0.02  # below the largest |gradient| of the discriminator (asserted on the DDP run)


class ClippedGAN(pl.LightningModule):
    """Manual optimization: G (Adam) clipped by norm, D (SGD with momentum) clipped by value."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 6)])
        self.disc = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 1)])
        self.stats: dict[str, list[float]] = {"g_norm": [], "d_max": []}

    def generate(self, z: Tensor) -> Tensor:
        return self.gen[1](torch.tanh(self.gen[0](z)))

    def discriminate(self, x: Tensor) -> Tensor:
        return self.disc[1](torch.tanh(self.disc[0](x))).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        z, real = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits

        d_fake = self.discriminate(self.generate(z))
        self.manual_backward(bce(d_fake, torch.ones_like(d_fake)))  # reaches D's parameters too
        self._record("g_norm", [p.grad for p in self.gen.parameters()], lambda g: torch.linalg.vector_norm(g))
        self.clip_gradients(opt_g, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()  # the generator's loss left gradients on D: they must not reach D's step

        d_real, d_fake = self.discriminate(real), self.discriminate(self.generate(z).detach())
        self.manual_backward(bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake)))
        self._record("d_max", [p.grad for p in self.disc.parameters()], lambda g: g.abs().max())
        self.clip_gradients(opt_d, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")
        opt_d.step()
        opt_d.zero_grad()

    def _record(self, key: str, grads: list[Tensor | None], measure: Any) -> None:
        """Under DDP the module holds the full, reduced gradients: record how much clipping has to do."""
        if all(g is not None for g in grads):
            self.stats[key].append(float(measure(torch.cat([g.reshape(-1) for g in grads if g is not None]))))

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.gen.parameters(), lr=1e-2, betas=(0.5, 0.9)),
            torch.optim.SGD(self.disc.parameters(), lr=0.1, momentum=0.5),
        )


Fit = tuple[dict[str, Tensor], dict[str, list[float]]]  # the final weights, the clipping stats


STRATEGIES = {
    "ddp": lambda: DDPStrategy(find_unused_parameters=True),
    "zero1": lambda: ZeroStrategy(stage=1),
    "zero2": lambda: ZeroStrategy(stage=2),
    "zero3": lambda: ZeroStrategy(stage=3),
}


def fit_each(rank: int, world: int) -> dict[str, Fit]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK), DDP then every
    stage, each fitting the clipped GAN from the same seed on the same data: its final weights and clipping stats."""
    as_launched_rank(rank, world)
    out = {}
    for name, make in STRATEGIES.items():
        pl.seed_everything(0, verbose=False)
        model = ClippedGAN()
        kwargs = trainer_kwargs(devices=world, max_epochs=1, accumulate_grad_batches=1, gradient_clip_val=None)
        trainer = pl.Trainer(strategy=make(), **kwargs)
        trainer.fit(model, DataLoader(NoiseAndReal(), batch_size=4))
        out[name] = (state_of(model), model.stats)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Fit]]:
    return run_ranks(fit_each, 2, timeout_s=100)


@pytest.fixture(scope="module")
def ddp_clipped_gan(runs: list[dict[str, Fit]]) -> list[dict[str, Tensor]]:
    """DDP's final weights on each rank, once its run is shown to clip at every iteration."""
    for rank_runs in runs:
        _, stats = rank_runs["ddp"]
        # 32 samples / (2 ranks x 4) = 4 iterations; clipping must bite at every one for the comparison to cover it
        assert len(stats["g_norm"]) == len(stats["d_max"]) == 4
        assert min(stats["g_norm"]) > 2 * CLIP_NORM and min(stats["d_max"]) > 2 * CLIP_VALUE, stats
    return [rank_runs["ddp"][0] for rank_runs in runs]


@pytest.mark.timeout(120)  # the first one runs the 4 fits on 2 ranks: 0.5 s measured
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_manual_optimization_with_clipping_matches_ddp(
    runs: list[dict[str, Fit]],
    ddp_clipped_gan: list[dict[str, Tensor]],
    stage: int,
) -> None:
    for rank, (rank_runs, ddp_state) in enumerate(zip(runs, ddp_clipped_gan, strict=True)):
        got, _ = rank_runs[f"zero{stage}"]
        assert_state_close(got, ddp_state, rel=1e-5, what=f"clipped GAN, rank {rank}, stage {stage} vs ddp")
