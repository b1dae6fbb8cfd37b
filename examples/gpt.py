"""A small character-level GPT as a LightningModule: the model the example trains with ZeRO.

[Note: written to survive ZeRO-3]
Under stage 3 the strategy frees every parameter outside forward/backward (its storage may be empty), so this
module never reads a parameter's values or shape after ``__init__``: the weight-decay split in
``configure_optimizers`` is decided by module type and parameter name, positions come from ``torch.arange`` at
call time, and the causal mask comes from ``scaled_dot_product_attention(is_causal=True)`` instead of a cached
buffer. Nothing holds on to a parameter tensor either, so the strategy can swap storages freely.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torchmetrics.text import Perplexity


@dataclass(kw_only=True)
class GPTConfig:
    """Shape and optimisation settings of :class:`GPT` (also the Hydra schema of the ``model`` group)."""

    vocab_size: int
    """Number of distinct tokens (characters); filled in from the data, never set by hand."""

    block_size: int = 64
    """Longest context the model sees (size of the positional embedding table)."""

    n_layer: int = 4
    """Number of transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int = 128
    """Width of the residual stream."""

    dropout: float = 0.0
    """Dropout probability after embeddings, attention and MLP (0 for short runs)."""

    learning_rate: float = 3e-3
    """Peak learning rate of AdamW."""

    weight_decay: float = 0.1
    """Weight decay of the matrix weights (biases, LayerNorm and embeddings get none)."""

    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's moving-average coefficients."""

    lr_schedule: bool = True
    """Linear warmup then cosine decay to ``min_lr_ratio * learning_rate``; off: constant learning rate."""

    warmup_steps: int = 20
    """Optimizer steps of linear warmup (only with ``lr_schedule``)."""

    min_lr_ratio: float = 0.1
    """Learning rate at the end of the cosine, as a fraction of the peak."""

    def __post_init__(self) -> None:
        # OmegaConf hands sequences over as lists; the optimizer wants a pair.
        self.betas = _as_pair(self.betas)
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r} must be a positive integer.")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide n_embd={self.n_embd}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1).")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"warmup_steps={self.warmup_steps!r} must be >= 0 and min_lr_ratio={self.min_lr_ratio!r} in [0, 1]."
            )


def _as_pair(values: Any) -> tuple[float, float]:
    """``betas`` as a tuple of two floats, whatever sequence it arrived as."""
    pair = tuple(float(v) for v in values)
    if len(pair) != 2:
        raise ValueError(f"betas={list(values)!r} must hold exactly two numbers.")
    return pair[0], pair[1]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position attends only to itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (batch, time, n_embd) -> same shape."""
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, time, width) -> (batch, heads, time, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: widen four times, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (batch, time, n_embd) -> same shape."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    This is the natural ZeRO-3 communication unit (``unit_modules: [Block]`` in ``conf/strategy``).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (batch, time, n_embd) -> same shape."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class WarmupCosine:
    """Learning-rate multiplier for ``LambdaLR``: linear warmup to 1, then cosine down to ``min_ratio``.

    A dataclass rather than a closure so that ``LambdaLR.state_dict()`` can save it with a checkpoint.
    """

    warmup_steps: int
    total_steps: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate for optimizer step ``step`` (counted from 0)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPT(LightningModule):
    """Decoder-only transformer over characters, with the output layer tied to the token embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.save_hyperparameters(asdict(config))
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tied: one Parameter reachable from two modules, the case a sharding strategy must not duplicate.
        self.lm_head.weight = self.tok_emb.weight
        self.val_perplexity = Perplexity()
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 style initialisation; runs once at construction, while every parameter is still whole."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # Residual projections are scaled down so the residual stream's variance does not grow with depth.
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_parameters(self) -> int:
        """Distinct parameters' element count (the tied matrix once). Meaningful before a strategy shards them."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids (batch, time) -> next-token logits (batch, time, vocab_size)."""
        _, time = idx.shape
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size={self.config.block_size}.")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-character cross-entropy (nats)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """One micro-batch: forward, loss, log it (averaged over ranks)."""
        inputs, targets = batch
        loss = self.loss(self(inputs), targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Validation loss (mean over ranks) and perplexity (token-weighted, synced by torchmetrics)."""
        inputs, targets = batch
        logits = self(inputs)
        loss = self.loss(logits, targets)
        self.val_perplexity.update(logits, targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=inputs.size(0))
        self.log("val_ppl", self.val_perplexity, prog_bar=True)

    def _param_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: decay on Linear weights; none on biases, LayerNorm and embeddings (the tied one included).

        Decided by module type and parameter name, never by shape: see [Note: written to survive ZeRO-3].
        """
        no_decay: set[int] = set()
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if name == "bias" or isinstance(module, (nn.LayerNorm, nn.Embedding)):
                    no_decay.add(id(param))
        params = list(self.parameters())  # each distinct Parameter once, tied weight included
        return [
            {"params": [p for p in params if id(p) not in no_decay], "weight_decay": self.config.weight_decay},
            {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW over the two groups, plus a per-step warmup-cosine ``LambdaLR`` when ``lr_schedule`` is on."""
        cfg = self.config
        optimizer = torch.optim.AdamW(self._param_groups(), lr=cfg.learning_rate, betas=cfg.betas)
        if not cfg.lr_schedule:
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        schedule = WarmupCosine(warmup_steps=cfg.warmup_steps, total_steps=total, min_ratio=cfg.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
