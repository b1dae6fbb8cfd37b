"""A small tensor-parallel model for the engine, checkpoint and Fabric tests of tensor parallelism: fast on 4 CPU
ranks, and covering every placement a plan gives a parameter: ``Shard(0)`` (the embedding rows, column-wise
weights and biases), ``Shard(1)`` (row-wise weights), ``Replicate()`` (row-wise biases, and the SequenceParallel
norms, whose gradients autograd leaves ``Partial`` over the TP ranks).

The math reference is one process without TP doing the same steps on the global batch: with per-rank batch ``b``
over ``dp`` data-parallel ranks, the mean loss of ``dp * b`` rows (rank ``d`` takes rows ``d*b .. d*b+b-1``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset

VOCAB, DIM, SEQ, LAYERS = 32, 16, 8, 2


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class ToyNet(nn.Module):
    """Embedding -> blocks (LayerNorm, Linear, ReLU, Linear, residual) -> LayerNorm -> Linear to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def apply_plan(model: ToyNet, tp_mesh: DeviceMesh) -> None:
    """Sequence parallel between the blocks (activations ``Shard(1)``), column- then row-wise inside each."""
    parallelize_module(model, tp_mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "norm": SequenceParallel(),
            "w1": ColwiseParallel(input_layouts=Shard(1)),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def make_model(seed: int = 0) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet()


def loss_of(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    tokens, targets = batch
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


class Tokens(Dataset):
    """Sample ``i``: SEQ input tokens and SEQ targets, a function of ``i`` alone."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        generator = torch.Generator().manual_seed(1000 + index)
        return (torch.randint(0, VOCAB, (SEQ,), generator=generator),
                torch.randint(0, VOCAB, (SEQ,), generator=generator))


def global_batch(step: int, rows: int, samples: int = 64) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch when the data-parallel ranks together take ``rows`` samples per step of
    ``Tokens(samples)``: Lightning's DistributedSampler for training shuffles (each epoch a permutation of the
    dataset, seeded 0 + epoch), and rank ``d`` of ``dp`` takes every ``dp``-th index from ``d``, so step ``s`` of an
    epoch covers positions ``s*rows .. s*rows+rows-1`` of that epoch's permutation (the mean loss does not depend on
    which rank took which)."""
    epoch, within = divmod(step, samples // rows)
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch)).tolist()
    dataset = Tokens(samples)
    picked = [dataset[order[within * rows + j]] for j in range(rows)]
    return torch.stack([s[0] for s in picked]), torch.stack([s[1] for s in picked])


def reference_states(
    steps: int, rows: int, lr: float = 1e-2, clip: float | None = None, samples: int = 64
) -> dict[str, Tensor]:
    """One process, no TP: ``steps`` AdamW steps on the global batches of ``rows`` samples of ``Tokens(samples)``
    (:func:`global_batch`)."""
    return reference_run(steps, rows, lr, clip, samples)[0]


def reference_run(
    steps: int, rows: int, lr: float = 1e-2, clip: float | None = None, samples: int = 64
) -> tuple[dict[str, Tensor], list[float]]:
    """:func:`reference_states` and the loss of every step."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(model, global_batch(step, rows, samples))
        losses.append(float(loss.detach()))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}, losses


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole (unsharded over TP) values of ``model``'s state: DTensors gathered (a collective over TP)."""
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for key, value in model.state_dict().items()}


class ToyTPModule(pl.LightningModule):
    """ToyNet for the Trainer: the plan applied in ``configure_model`` from ``self.device_mesh`` (as a module
    written for ModelParallelStrategy does), AdamW, ``rows`` samples per rank and step (the strategy's sampler deals
    them to the data-parallel ranks: :func:`global_batch` with ``rows * dp`` is a step's global batch)."""

    def __init__(self, rows: int = 2, samples: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = make_model()
        self.rows, self.samples, self.lr = rows, samples, lr
        self.losses: list[float] = []

    def configure_model(self) -> None:
        apply_plan(self.net, self.device_mesh["tensor_parallel"])
        if isinstance(self.trainer.strategy, ModelParallelStrategy):  # FSDP2 over data_parallel; ZeRO shards itself
            for block in self.net.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = loss_of(self.net, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(self.samples), batch_size=self.rows, shuffle=False)


class PlainTPModule(ToyTPModule):
    """The same module without a tensor-parallel plan (a run without tensor parallelism)."""

    def configure_model(self) -> None:
        pass
