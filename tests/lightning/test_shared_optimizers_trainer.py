"""Through Lightning: a GAN under manual optimization whose generator's optimizer also covers a layer the
discriminator's holds, logging gradient norms in ``on_before_optimizer_step`` — against DDP.

ZeRO (zero1, and zero3 on one host's shared memory) ends with DDP's weights; ``zero_strategy.grad_norm(self, 2)``
and Lightning's own ``grad_norm`` give the keys and values Lightning's ``grad_norm`` gives under DDP at every step
of both optimizers; and the shared layer's ``p.grad`` read there holds DDP's values.
The engine-level tests (tests/distributed/test_shared_optimizers.py, test_grad_norm.py) cover the stages,
patterns and transports; this is the same through the Trainer's hooks, in 3 fits (DDP, stage 1, stage 3), each on
2 ranks of a ``run_ranks`` launch of its own that Lightning takes for ranks torchrun started.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.compare import assert_state_close, assert_values_close
from helpers.launched import as_launched_rank
from helpers.lit import NoiseAndReal, state_of, trainer_kwargs
from helpers.shared_optimizers import SharedGAN, gan_optimizers
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn
from torch.utils.data import DataLoader

import zero_strategy
from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks


class SharedLayerGAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = SharedGAN()
        self.norms: list[dict[str, float]] = []
        self.lightning_norms: list[dict[str, float]] = []
        self.shared_grads: list[torch.Tensor | None] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        z, real = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        d_fake = self.net.discriminate(self.net.generate(z))
        self.manual_backward(bce(d_fake, torch.ones_like(d_fake)))  # reaches D's layers and the shared one
        opt_g.step()
        opt_g.zero_grad()  # the shared layer's gradient is gone for D too
        opt_d.zero_grad()
        d_real, d_fake = self.net.discriminate(real), self.net.discriminate(self.net.generate(z).detach())
        self.manual_backward(bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake)))
        opt_d.step()
        opt_d.zero_grad()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norm = zero_strategy.grad_norm if isinstance(self.trainer.strategy, ZeroStrategy) else lightning_grad_norm
        self.norms.append({key: float(value) for key, value in norm(self, 2).items()})
        self.lightning_norms.append({key: float(value) for key, value in lightning_grad_norm(self, 2).items()})
        grad = self.net.shared.weight.grad  # DDP: the shared layer's averaged gradient
        self.shared_grads.append(None if grad is None else grad.detach().clone())

    def configure_optimizers(self) -> Any:
        return gan_optimizers(self.net)


Fit = tuple[dict[str, torch.Tensor], dict[str, Any]]  # the final weights, what the hooks recorded


STRATEGIES = {
    "ddp": lambda: DDPStrategy(find_unused_parameters=True),
    "zero1": lambda: ZeroStrategy(stage=1),
    "zero3": lambda: ZeroStrategy(stage=3),
}


def fit_one(rank: int, world: int, strategy: str) -> Fit:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK), the GAN fitted
    under ``strategy`` (a key of STRATEGIES) from the same seed on the same data as every other strategy."""
    as_launched_rank(rank, world)
    pl.seed_everything(0, verbose=False)
    model = SharedLayerGAN()
    kwargs = trainer_kwargs(devices=world, max_epochs=1, accumulate_grad_batches=1, gradient_clip_val=None)
    trainer = pl.Trainer(strategy=STRATEGIES[strategy](), **kwargs)
    trainer.fit(model, DataLoader(NoiseAndReal(), batch_size=4))
    return state_of(model), {"norms": model.norms, "lightning": model.lightning_norms, "shared": model.shared_grads}


@pytest.fixture(scope="module")
def ddp_run() -> list[Fit]:
    """DDP's fit on each rank, once its records are shown to be what the comparison needs."""
    runs = run_ranks(fit_one, 2, "ddp", timeout_s=50)
    for _, record in runs:  # 4 iterations, 2 optimizer steps each; under DDP p.grad is there
        assert len(record["norms"]) == 8 and all(grad is not None for grad in record["shared"])
        assert record["lightning"] == record["norms"]
        assert all("grad_2.0_norm/net.disc.0.weight" in norms for norms in record["norms"][::2])  # G's loss reached D
        assert not any("grad_2.0_norm/net.gen.0.weight" in norms for norms in record["norms"][1::2])  # cleared
    return runs


@pytest.mark.timeout(120)  # one fit on 2 ranks (two with DDP's): 0.5 s measured
@pytest.mark.parametrize("stage", [1, 3])
def test_shared_layer_gan_matches_ddp_with_its_gradient_norms(ddp_run: list[Fit], stage: int) -> None:
    runs = run_ranks(fit_one, 2, f"zero{stage}", timeout_s=50)
    for rank, ((state, got), (ddp_state, want)) in enumerate(zip(runs, ddp_run, strict=True)):
        assert_state_close(state, ddp_state, rel=1e-5, what=f"shared-layer GAN, rank {rank}, stage {stage} vs ddp")
        assert len(got["norms"]) == len(want["norms"])
        for kind in ("norms", "lightning"):  # ours, and Lightning's own over p.grad
            for step, (ours, theirs) in enumerate(zip(got[kind], want["norms"], strict=True)):
                assert list(ours) == list(theirs), f"rank {rank}, step {step}: {sorted(set(ours) ^ set(theirs))}"
                assert_values_close(list(ours.values()), list(theirs.values()), rel=1e-5,
                                    what=f"rank {rank}, step {step}, {kind}")
        for step, (ours, theirs) in enumerate(zip(got["shared"], want["shared"], strict=True)):
            assert ours is not None, f"rank {rank}, step {step}: the shared layer's p.grad is None"
            assert_state_close({"shared": ours}, {"shared": theirs}, rel=1e-5, what=f"rank {rank}, step {step}")
