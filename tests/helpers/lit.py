"""LightningModules, data and Trainer settings for tests/lightning.

Everything a spawned rank needs is importable from here (the spawn launcher pickles the module and trainer).
Per-rank observations are written to ``out_dir`` as ``{what}_rank{r}.pt`` files, because with spawn launching
only rank 0's weights and ``callback_metrics`` come back to the main process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import zero_strategy
from helpers.models import SEQ, VOCAB, TiedLM, lm_loss
from helpers.storage import private_storage_bytes

N_TRAIN = 56  # 2 ranks × 7 batches of 4: accumulate_grad_batches=3 leaves a partial window of 1 each epoch
N_VAL = 16
N_TEST = 32
BATCH = 4
LR = 0.1
CLIP = 0.05
FROZEN = "net.blocks.1"


class IndexedTokens(Dataset):
    """Token sequences that also return their index, so a test can see which rank got which sample."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[int, Tensor]:
        return i, self.tokens[i]


def loader(n: int, seed: int) -> DataLoader:
    return DataLoader(IndexedTokens(n, seed), batch_size=BATCH, shuffle=False)


def train_loader() -> DataLoader:
    return loader(N_TRAIN, 11)


def val_loader() -> DataLoader:
    return loader(N_VAL, 12)


def test_loader() -> DataLoader:
    return loader(N_TEST, 13)


class LitTiedLM(pl.LightningModule):
    """The tied-embedding model with a frozen middle block, logging data-only metrics that a test can compute
    without training (the mean sample index), and recording per-rank facts to ``out_dir``."""

    def __init__(self, out_dir: str | None = None) -> None:
        super().__init__()
        self.net = TiedLM(n_blocks=3)
        for p in self.get_submodule(FROZEN).parameters():
            p.requires_grad_(False)
        self.idx_metric = torchmetrics.MeanMetric()
        # a plain tensor attribute changed in place (as a metric's state is): each rank must count only its own
        self.batches_counted = torch.zeros((), dtype=torch.int64)
        self.out_dir = out_dir
        self.seen: list[list[int]] = []
        self.grad_norms: list[float] = []
        self.reports: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------ train
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        idx, tokens = batch
        loss = lm_loss(self.net, tokens)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("idx_mean", idx.float().mean(), on_step=False, on_epoch=True, sync_dist=True)
        self.idx_metric.update(idx.float())
        self.log("idx_metric", self.idx_metric, on_step=False, on_epoch=True)
        self.seen[-1].extend(idx.tolist())
        self.batches_counted += 1
        return loss

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # DDP: from p.grad; ZeRO: from the master slices' gradients (a collective, every rank calls it here)
        norms = zero_strategy.grad_norm(self, 2)
        if norms:
            self.grad_norms.append(norms["grad_2.0_norm_total"].item())

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        if hasattr(strategy, "memory_report"):
            report = strategy.memory_report()
            self.reports["memory"] = (report.parameters, report.gradients, report.optimizer_state)
            self.reports["communication"] = dict(strategy.communication_report())
        self.reports["global_step"] = self.trainer.global_step
        # storage of the module's own (a stage-3 buffer the host's ranks share in shared memory is not)
        engine = getattr(strategy, "engine", None)
        self.reports["param_storage_bytes"] = private_storage_bytes(self.parameters(), engine)
        self.reports["batches_counted"] = int(self.batches_counted)
        self._dump("train", {"seen": self.seen, "grad_norms": self.grad_norms, "reports": self.reports})

    # ---------------------------------------------------------------------------------------- evaluation
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, tokens = batch
        self.log("val_loss", lm_loss(self.net, tokens), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        idx, tokens = batch
        self.log("test_loss", lm_loss(self.net, tokens), sync_dist=True)
        self.log("test_idx_mean", idx.float().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[Tensor, Tensor]:
        idx, tokens = batch
        logits = self.net(tokens)
        self.predictions.append((idx.clone(), logits.clone()))
        return idx, logits

    def on_predict_start(self) -> None:
        self.predictions: list[tuple[Tensor, Tensor]] = []

    def on_predict_end(self) -> None:
        # spawn launching returns no predictions to the main process: each rank writes its own
        self._dump("predict", self.predictions)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)

    def _dump(self, what: str, value: Any) -> None:
        if self.out_dir is not None:
            torch.save(value, Path(self.out_dir) / f"{what}_rank{self.global_rank}.pt")


class LitTiedLMWithLBFGS(LitTiedLM):
    """The same model with an optimizer that needs whole tensors (ZeRO must refuse it)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


def read_rank_files(out_dir: str | Path, what: str, world_size: int = 2) -> list[Any]:
    return [torch.load(Path(out_dir) / f"{what}_rank{r}.pt", weights_only=False) for r in range(world_size)]


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "accumulate_grad_batches": 3,
        "gradient_clip_val": CLIP,
    }
    kwargs.update(overrides)
    return kwargs


def fit_lm(
    strategy: Any, out_dir: str | None, model_cls: type[LitTiedLM] = LitTiedLM, **overrides: Any
) -> tuple[LitTiedLM, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = model_cls(out_dir)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(**overrides))
    trainer.fit(model, train_loader(), val_loader())
    return model, trainer


def state_of(module: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ------------------------------------------------------------------------------------------------------ GAN
class NoiseAndReal(Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(5)
        self.z = torch.randn(n, 4, generator=g)
        self.real = torch.randn(n, 6, generator=g) + 1.0

    def __len__(self) -> int:
        return len(self.z)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.z[i], self.real[i]


class LitGAN(pl.LightningModule):
    """Manual optimization with two optimizers: the generator's loss backpropagates through the discriminator."""

    def __init__(self, toggle: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        self.gen = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 6)])
        self.disc = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 1)])

    def generate(self, z: Tensor) -> Tensor:
        return self.gen[1](torch.tanh(self.gen[0](z)))

    def discriminate(self, x: Tensor) -> Tensor:
        return self.disc[1](torch.tanh(self.disc[0](x))).squeeze(-1)

    def _player_step(self, optimizer: Any, loss_fn: Any) -> None:
        if self.toggle:
            self.toggle_optimizer(optimizer)
        optimizer.zero_grad()
        self.manual_backward(loss_fn())
        optimizer.step()
        if self.toggle:
            self.untoggle_optimizer(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        z, real = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits

        def d_loss() -> Tensor:
            d_real, d_fake = self.discriminate(real), self.discriminate(self.generate(z).detach())
            return bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))

        def g_loss() -> Tensor:
            d_fake = self.discriminate(self.generate(z))
            return bce(d_fake, torch.ones_like(d_fake))

        self._player_step(opt_d, d_loss)
        self._player_step(opt_g, g_loss)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.gen.parameters(), lr=1e-2, betas=(0.5, 0.9)),
            torch.optim.SGD(self.disc.parameters(), lr=0.1, momentum=0.5),
        )


def fit_gan(strategy: Any, toggle: bool = True) -> dict[str, Tensor]:
    pl.seed_everything(0, verbose=False)
    model = LitGAN(toggle)
    trainer = pl.Trainer(
        strategy=strategy,
        **trainer_kwargs(max_epochs=1, accumulate_grad_batches=1, gradient_clip_val=None),
    )
    trainer.fit(model, DataLoader(NoiseAndReal(), batch_size=4))
    return state_of(model)
