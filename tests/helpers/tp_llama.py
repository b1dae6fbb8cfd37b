"""A small Llama-style model, the tensor-parallel plan of torch's own TP tutorial, and a LightningModule that applies
it under any strategy exposing ``self.device_mesh`` with dims ("data_parallel", "tensor_parallel").

The model follows the tutorial's names (``tok_embeddings``, ``layers.N.attention.wq`` ..., ``attention_norm``,
``feed_forward.w1/w2/w3``, ``ffn_norm``, ``norm``, ``output``) so that :func:`apply_tp_plan` is the tutorial's plan
(https://docs.pytorch.org/tutorials/intermediate/TP_tutorial.html) word for word: attention and MLP column-/row-wise,
norms sequence-parallel, the embedding row-wise into sequence-sharded activations, the output column-wise back to
replicated logits. The same module without the plan is the single-process reference.

Positions are rotary, computed inside attention from the (global) sequence length: no buffer, so nothing but
parameters needs sharding or checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Sizes of :class:`TPLlama`. Every TP-sharded dimension (heads, ``ffn_hidden``, ``vocab``, ``seq``) must be
    divisible by the tensor-parallel size (checked by :func:`apply_tp_plan`)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab: int = 128
    seq: int = 16
    """Tokens the model reads per sample (a sample holds ``seq + 1``: the last is only a target)."""
    ffn_hidden: int = 192
    """SwiGLU's hidden width (Llama's 8/3 * dim, rounded up to a multiple of 32)."""
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """RMSNorm in Python: SequenceParallel supports this form (and LayerNorm), not every fused kernel."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim): each pair of features turned by an angle
    proportional to the position (computed here from the sequence length, so there is no buffer to shard)."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)  # (seq, head_dim / 2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal multi-head attention with q/k/v/o projections (no bias). ``n_heads`` is the heads *this rank* holds:
    :func:`apply_tp_plan` divides it by the TP size, as the tutorial does, because wq/wk/wv column-wise produce only
    the local heads' features."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq = x.shape[0], x.shape[1]  # under TP x is a replicated DTensor: its global shape
        q, k, v = (w(x).view(batch, seq, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q), rotate(k)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TPLlama(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm, output Linear (untied)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_llama(config: LlamaConfig | None = None, seed: int = 0) -> TPLlama:
    """The model with values that depend on ``seed`` only (not on the global RNG, the rank or the world size).
    The norms' weights start away from 1 so that their gradients (reduced over the TP group under SequenceParallel)
    matter to the comparison."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TPLlama(config or LlamaConfig())
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.uniform_(0.5, 1.5)
    return model


def apply_tp_plan(model: TPLlama, tp_mesh: DeviceMesh) -> TPLlama:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` with the tutorial's plan; returns ``model``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    config, tp = model.config, tp_mesh.size()
    sharded = {"n_heads": config.n_heads, "ffn_hidden": config.ffn_hidden, "vocab": config.vocab, "seq": config.seq}
    uneven = {name: size for name, size in sharded.items() if size % tp}
    if uneven:
        raise ValueError(f"LlamaConfig sizes {uneven} are not divisible by the tensor-parallel size {tp}: choose "
                         f"sizes that are multiples of {tp}, or a tensor-parallel size that divides them")
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    })
    for block in model.layers:
        assert isinstance(block, TransformerBlock)
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
        # wq/wk/wv column-wise leave this rank the features of n_heads / tp heads (the tutorial's adjustment)
        block.attention.n_heads = config.n_heads // tp
    return model


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy over ``tokens`` (batch, seq + 1), the mean over every position."""
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class TokenSamples(Dataset):
    """``n`` samples of ``seq + 1`` random tokens, each returned with its index (a test sees who trained on what)."""

    def __init__(self, n: int, config: LlamaConfig, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, config.vocab, (n, config.seq + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[int, Tensor]:
        return index, self.tokens[index]


ADAMW_EPS = 1e-5
"""AdamW's eps here. With torch's default (1e-8) an element whose gradient is near zero moves by ``lr * g / eps``,
which turns float rounding of ``g`` (the order of a sum differs between one process and a TP x DP mesh) into
relative weight differences near 1e-4 after 4 steps; 1e-6 keeps the comparison at rounding while every other
element's update is unchanged (``|g| >> eps``)."""


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer both the reference and every strategy's run use. ``foreach=False``: the same per-tensor
    arithmetic on plain tensors and on DTensors."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, eps=ADAMW_EPS, weight_decay=0.01, foreach=False)
    raise ValueError(f"optimizer {name!r} is not one of {OPTIMIZERS}")


class TPLlamaModule(pl.LightningModule):
    """:class:`TPLlama` for the Trainer. ``configure_model`` applies the TP plan over the strategy's
    ``device_mesh["tensor_parallel"]``; under Lightning's ``ModelParallelStrategy`` it also applies FSDP2 per block
    and on the model over ``device_mesh["data_parallel"]`` (ZeRO shards over that dimension itself). Records this
    rank's loss per step, the sample indices it trained on and each parameter's layout at the start of training."""

    def __init__(self, config: LlamaConfig | None = None, optimizer: str = "sgd", lr: float = 0.05,
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {optimizer!r} is not one of {OPTIMIZERS}")
        self.model = build_llama(config, seed)
        self.optimizer_name, self.lr = optimizer, lr
        self.losses: list[float] = []
        self.seen: list[int] = []
        self.layouts: dict[str, dict[str, str]] = {}
        self._parallelized = False

    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._parallelized:  # a later fit/test calls configure_model again on the built model
            return
        mesh = self.device_mesh
        if mesh is None:
            raise RuntimeError("TPLlamaModule needs a strategy that sets self.device_mesh (ModelParallelStrategy, or "
                               "ZeroStrategy(tensor_parallel_size=K))")
        apply_tp_plan(self.model, mesh["tensor_parallel"])
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            # per block and on the model: the Trainer calls training_step, not forward, so a root-only wrap of the
            # LightningModule would never gather; wrapping self.model (called in training_step) does
            for block in self.model.layers:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])
        self._parallelized = True

    def on_train_start(self) -> None:
        from torch.distributed.tensor import DTensor

        # what the strategy made of each parameter: its placement on each named mesh dimension ({} when plain)
        self.layouts = {
            name: dict(zip(p.device_mesh.mesh_dim_names or (), map(repr, p.placements), strict=True))
            if isinstance(p, DTensor) else {}
            for name, p in self.model.named_parameters()
        }

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        indices, tokens = batch
        loss = lm_loss(self.model, tokens)
        self.losses.append(float(loss.detach()))
        self.seen.extend(int(i) for i in indices)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters(), self.lr)
