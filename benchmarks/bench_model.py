"""The benchmark's model and data: a small GPT (token + position embedding, a ModuleList of pre-norm blocks, a
final LayerNorm and an output layer tied to the token embedding) trained in fp32 on random tokens.

[Note: written to survive ZeRO-3 and FSDP2]
Stage 3 and ``fully_shard`` free or swap parameters outside forward/backward, so the model never reads a parameter
after ``__init__``: positions come from ``torch.arange`` at call time and the causal mask from
``scaled_dot_product_attention(is_causal=True)``, not from a cached buffer. It has no buffers at all, so no
method spends communication on buffer broadcasts and the byte counts compare parameter traffic alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The size of the benchmark model and of one rank's batch."""

    vocab_size: int
    max_seq: int  # rows of the position table; the sequence length a batch uses may be shorter
    width: int
    n_layer: int
    n_head: int
    batch: int  # sequences per rank per step (default of --batch)
    seq: int  # tokens per sequence (default of --seq)


PRESETS: dict[str, ModelShape] = {
    # ~29 k parameters: the smoke test's model, seconds per method
    "tiny": ModelShape(vocab_size=97, max_seq=32, width=32, n_layer=2, n_head=2, batch=2, seq=16),
    # ~5.3 M parameters (0.56 M in the embeddings, 0.79 M per block)
    "5m": ModelShape(vocab_size=2048, max_seq=128, width=256, n_layer=6, n_head=4, batch=4, seq=64),
    # ~29.5 M parameters (4.2 M in the embeddings, 3.1 M per block)
    "30m": ModelShape(vocab_size=8192, max_seq=128, width=512, n_layer=8, n_head=8, batch=4, seq=64),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4× GELU MLP, each on a residual branch."""

    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_attn = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_mlp = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=-1)
        heads = [t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class BenchGPT(nn.Module):
    """Token + position embedding, ``blocks`` (an ``nn.ModuleList``: one ZeRO/FSDP unit each), tied output layer."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.width)
        self.pos_emb = nn.Embedding(shape.max_seq, shape.width)
        self.blocks = nn.ModuleList(Block(shape.width, shape.n_head) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one parameter, counted once in Ψ

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(shape: ModelShape, seed: int = 0) -> BenchGPT:
    """The same initial weights on every rank and for every method (seeded)."""
    torch.manual_seed(seed)
    return BenchGPT(shape)


def parameter_count(model: nn.Module) -> int:
    """Ψ: distinct parameters (the tied embedding/output weight once)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy over ``tokens`` (``batch × (seq + 1)``)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def rank_batches(shape: ModelShape, steps: int, batch: int, seq: int, rank: int, world_size: int) -> list[Tensor]:
    """This rank's slice of ``steps`` global batches of random tokens; identical for every method."""
    generator = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, shape.vocab_size, (world_size * batch, seq + 1), generator=generator)
        batches.append(tokens[rank * batch : (rank + 1) * batch].clone())
    return batches


def warm_up_kernels() -> None:
    """One plain step of the tiny model, so that the code pages of the compute kernels (libtorch is hundreds of
    MiB, paged in on first use) are resident before a peak-RSS baseline and not counted as a method's memory."""
    shape = PRESETS["tiny"]
    model = build_model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm_loss(model, torch.randint(0, shape.vocab_size, (shape.batch, shape.seq + 1))).backward()
    optimizer.step()
