"""Models whose construction exercises what sharded (meta-device) construction must reproduce bit for bit: tied
weights and a parent re-initializing its children (TiedLM), nn.Transformer's xavier re-init of every child, and
buffers computed at construction (a positional table; random buffers drawn between parameter inits)."""

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


def build(kind: str) -> nn.Module:
    if kind == "tied":
        return TiedLM(width=WIDTH)
    if kind == "transformer":
        return TransformerLM()
    raise ValueError(kind)
