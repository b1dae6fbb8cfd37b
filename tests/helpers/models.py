"""Small models and data for the ZeRO tests, and single-process reference training loops (plain torch only)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

# the parity comparisons live in helpers.compare; re-exported here for the tests that import them from models
from helpers.compare import assert_state_close as assert_state_close
from helpers.compare import max_rel_err as max_rel_err

VOCAB = 11
WIDTH = 15  # odd on purpose: every unit's flat buffer needs padding for world sizes 2 and 4
SEQ = 6


class Block(nn.Module):
    """A residual pre-norm block: the communication unit the ZeRO planner picks from an ``nn.ModuleList``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class TiedLM(nn.Module):
    """Embedding → blocks → LayerNorm → output layer whose weight *is* the embedding's (tied)."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, n_blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():  # LayerNorm starts at (1, 0): make it non-trivial so its gradients matter
            for module in self.modules():
                if isinstance(module, nn.LayerNorm):
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.2, 0.2)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def make_model(seed: int = 0, **kwargs: int) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(**kwargs)


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """Next-token cross-entropy, mean over every position of the batch."""
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_batches(steps: int, accum: int, global_batch: int, vocab: int = VOCAB, seed: int = 1) -> list[list[Tensor]]:
    """``steps`` optimizer steps of ``accum`` micro-batches, each a global batch of token sequences."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (global_batch, SEQ), generator=g) for _ in range(accum)] for _ in range(steps)]


def rank_slice(batch: Tensor, rank: int, world_size: int) -> Tensor:
    per = batch.shape[0] // world_size
    assert per * world_size == batch.shape[0], "the global batch must split evenly"
    return batch[rank * per : (rank + 1) * per]


def clone_state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
