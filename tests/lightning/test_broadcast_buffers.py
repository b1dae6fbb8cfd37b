"""``broadcast_buffers=True`` against DDP's option of the same name, in real 2-rank Trainer fits.

What ZeRO does: every training forward starts from rank 0's buffers (BatchNorm running statistics); evaluation
forwards never broadcast. What DDP does: it broadcasts before a forward only if the previous forward synchronised
gradients, so with ``accumulate_grad_batches=2`` only the first micro-batch of each window starts from rank 0's
statistics, and the first validation forward after training does. Each rank sees different data here (rank 1's
inputs are shifted), so a rank's statistics differ visibly from rank 0's whenever they were not broadcast.

Each rank records its statistics at the start of every training and validation forward (after any broadcast: the
strategy's hook runs before the step's forward) and at the end of fit. The four fits (ZeRO stage 3 and DDP, with and
without accumulation) run one after another in one launch of two ranks that run_ranks forks and Lightning takes for
ranks torchrun started (the launcher is not what is tested here); each rank returns its records.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.compare import assert_same_keys, tensor_abs_err
from helpers.launched import as_launched_rank
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

BATCH, TRAIN_BATCHES_PER_RANK, VAL_BATCHES_PER_RANK = 4, 6, 2
STATS = ("running_mean", "running_var", "num_batches_tracked")


class NormNet(pl.LightningModule):
    """Linear → BatchNorm1d → tanh → Linear, SGD; records its BatchNorm statistics on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)
        self.at_train_forward: list[dict[str, Tensor]] = []
        self.at_val_forward: list[dict[str, Tensor]] = []
        self.at_fit_end: dict[str, Tensor] = {}

    def _stats(self) -> dict[str, Tensor]:
        return {name: getattr(self.norm, name).detach().clone() for name in STATS}

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.norm(self.inp(x)))), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.at_train_forward.append(self._stats())
        return self._loss(batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.at_val_forward.append(self._stats())
        self._loss(batch)

    def on_fit_end(self) -> None:
        self.at_fit_end = self._stats()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(batches_per_rank: int, seed: int) -> DataLoader:
    """Sample i goes to rank i % 2 (the sampler does not shuffle); odd samples are shifted by 3 in every feature."""
    n = 2 * BATCH * batches_per_rank
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) + 3.0 * (torch.arange(n) % 2).unsqueeze(1)
    return DataLoader(TensorDataset(x, torch.randn(n, 1, generator=g)), batch_size=BATCH)


STRATEGIES = {
    "zero3": lambda: ZeroStrategy(stage=3, process_group_timeout_s=60.0),
    "ddp": lambda: "ddp",
}


def _fit(strategy: Any, accumulate: int) -> dict[str, Any]:
    """One fit on this rank (2 ranks); the statistics it recorded."""
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, accumulate_grad_batches=accumulate,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = NormNet()
    trainer.fit(module, _loader(TRAIN_BATCHES_PER_RANK, 1), _loader(VAL_BATCHES_PER_RANK, 2))
    return {"train": module.at_train_forward, "val": module.at_val_forward, "final": module.at_fit_end}


def fit_each(rank: int, world: int) -> dict[tuple[str, int], dict[str, Any]]:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK), ZeRO stage 3 and
    DDP, each without and with accumulation."""
    as_launched_rank(rank, world)
    return {(name, accumulate): _fit(make(), accumulate) for name, make in STRATEGIES.items() for accumulate in (1, 2)}


@pytest.fixture(scope="module")
def runs() -> Any:
    per_rank = run_ranks(fit_each, 2, timeout_s=100, pg_timeout_s=60.0)

    def get(name: str, accumulate: int) -> list[dict[str, Any]]:
        """Each rank's records of the fit of ``name`` with ``accumulate``, in rank order."""
        return [records[(name, accumulate)] for records in per_rank]

    return get


def _close(got: dict[str, Tensor], ref: dict[str, Tensor]) -> bool:
    """Within rounding of DDP's statistics; a non-finite value, missing key or changed shape on either side fails."""
    assert_same_keys(got, ref)
    return all(
        tensor_abs_err(got[k], ref[k], k) <= 1e-7 + 1e-5 * ref[k].double().abs().max().item() for k in STATS
    )


def _equal(got: dict[str, Tensor], ref: dict[str, Tensor]) -> bool:
    return all(torch.equal(got[k], ref[k]) for k in STATS)


def _apart(got: dict[str, Tensor], ref: dict[str, Tensor]) -> bool:
    """Far apart, not rounding: rank 1's data is shifted by 3, so its own statistics move away from rank 0's."""
    return bool((got["running_mean"] - ref["running_mean"]).abs().max() > 0.05)


# Each timeout covers the launch of all four fits if its test is the first to use `runs`: 1.5 s measured with
# both cores busy (the floor of 60 s rules)
@pytest.mark.timeout(120)
def test_with_accumulation_every_training_forward_starts_from_rank_0_unlike_ddp(runs: Any) -> None:
    zero, ddp = runs("zero3", 2), runs("ddp", 2)
    assert len(zero[0]["train"]) == len(ddp[0]["train"]) == 2 * TRAIN_BATCHES_PER_RANK
    # rank 0, whose statistics a checkpoint saves: the same as DDP's rank 0 at every forward and at the end
    for i, (got, ref) in enumerate(zip(zero[0]["train"], ddp[0]["train"], strict=True)):
        assert _close(got, ref), f"rank 0, training forward {i}: ZeRO's statistics differ from DDP's"
    assert _close(zero[0]["final"], ddp[0]["final"]), "rank 0's final statistics differ from DDP's"
    for i in range(2 * TRAIN_BATCHES_PER_RANK):
        # ZeRO: rank 1 starts every training forward from rank 0's statistics
        assert _equal(zero[1]["train"][i], zero[0]["train"][i]), f"ZeRO, training forward {i}: not rank 0's"
        # DDP: only the first micro-batch of each window does; the second starts from rank 1's own
        if i % 2 == 0:
            assert _equal(ddp[1]["train"][i], ddp[0]["train"][i]), f"DDP, first micro-batch {i}: not rank 0's"
        else:
            assert _apart(ddp[1]["train"][i], ddp[0]["train"][i]), f"DDP, second micro-batch {i}: rank 0's"


@pytest.mark.timeout(120)
def test_without_accumulation_training_matches_ddp_on_every_rank(runs: Any) -> None:
    zero, ddp = runs("zero3", 1), runs("ddp", 1)
    for rank in range(2):
        assert len(zero[rank]["train"]) == len(ddp[rank]["train"]) == 2 * TRAIN_BATCHES_PER_RANK
        for i, (got, ref) in enumerate(zip(zero[rank]["train"], ddp[rank]["train"], strict=True)):
            assert _close(got, ref), f"rank {rank}, training forward {i}: ZeRO's statistics differ from DDP's"
    assert _close(zero[0]["final"], ddp[0]["final"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_evaluation_forwards_are_not_broadcast_unlike_ddp(runs: Any, accumulate: int) -> None:
    """In validation each ZeRO rank uses the statistics it holds (rank 1's own last update); DDP's first validation
    forward after training adopts rank 0's. Rank 0's are the same under both."""
    zero, ddp = runs("zero3", accumulate), runs("ddp", accumulate)
    assert len(zero[0]["val"]) == len(ddp[0]["val"]) == 2 * VAL_BATCHES_PER_RANK
    for i in range(2 * VAL_BATCHES_PER_RANK):
        assert _close(zero[0]["val"][i], ddp[0]["val"][i]), f"rank 0, validation forward {i}"
        assert _equal(ddp[1]["val"][i], ddp[0]["val"][i]), f"DDP, validation forward {i}: not rank 0's"
        assert _apart(zero[1]["val"][i], zero[0]["val"][i]), f"ZeRO, validation forward {i}: rank 0's"
