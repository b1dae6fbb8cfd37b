"""Models whose construction exercises what sharded (meta-device) construction must reproduce bit for bit: tied
weights and a parent re-initializing its children (TiedLM), nn.Transformer's xavier re-init of every child,
buffers computed at construction (a positional table; random buffers drawn between parameter inits), and reseeds
inside the build (ReseededLM)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from helpers.models import SEQ, VOCAB, WIDTH, TiedLM


def sinusoid_table(length: int, width: int) -> Tensor:
    """The sin/cos positional table, computed with arange/exp/sin/cos (a buffer built from values at run time)."""
    position = torch.arange(length).unsqueeze(1)
    scale = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * scale)
    table[:, 1::2] = torch.cos(position * scale)
    return table


class TransformerLM(nn.Module):
    """nn.Transformer (parent re-initialization) between an embedding and a head, with a sin/cos position
    buffer computed in ``__init__`` and a random per-channel gain buffer drawn between parameter inits."""

    def __init__(self, vocab: int = VOCAB, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.core = nn.Transformer(width, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=24,
                                   dropout=0.0, batch_first=True)  # fmt: skip
        self.register_buffer("gain", 1 + 0.1 * torch.randn(width))
        self.head = nn.Linear(width, vocab)
        self.register_buffer("positions", sinusoid_table(SEQ, width))

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens) + self.positions[: tokens.shape[1]]
        h = self.core(h, h)
        return self.head(h * self.gain)


class ReseededLM(TransformerLM):
    """TransformerLM re-initialized with reseeds inside the build: a generator state read at its start and set back
    later (rank-dependent when the ranks were seeded differently: every rank must use rank 0's, as DDP broadcasts
    rank 0's values), ``torch.manual_seed``, and a ``fork_rng`` block after random draws. It also holds a random
    plain tensor attribute (``mixing``), which is neither a parameter nor a buffer."""

    def __init__(self) -> None:
        entry = torch.get_rng_state()
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(3)
            self.head.reset_parameters()
        nn.init.normal_(self.emb.weight, std=0.5)  # from the state fork_rng restored: after TransformerLM's draws
        torch.set_rng_state(entry)
        self.core.encoder.layers[0].linear1.reset_parameters()
        self.mixing = torch.rand(3)
        torch.manual_seed(11)
        self.register_buffer("offset", 0.1 * torch.randn(VOCAB))

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens) + self.offset


def build(kind: str) -> nn.Module:
    if kind == "tied":
        return TiedLM(width=WIDTH)
    if kind == "transformer":
        return TransformerLM()
    if kind == "reseeded":
        return ReseededLM()
    raise ValueError(kind)
