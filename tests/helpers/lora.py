"""Models with frozen base weights and small trainable low-rank adapters inside the same blocks: the ``peft``
package's LoRA on a Hugging Face GPT-2 built from a tiny config (nothing downloaded), and a hand-written one."""

from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB = 32
SEQ = 8


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen; B starts non-zero so every adapter gets a gradient."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(width, rank) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRABlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.ln.requires_grad_(False)
        self.fc = LoRALinear(width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class HandLoRALM(nn.Module):
    """Frozen embedding, blocks with a frozen LayerNorm and a LoRA linear, frozen output layer."""

    def __init__(self, width: int = 9, n_blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(LoRABlock(width) for _ in range(n_blocks))
        self.head = nn.Linear(width, VOCAB)
        self.emb.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_lora_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "hand":
        return HandLoRALM()
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    adapters = LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)  # GPT-2: Conv1D
    model = get_peft_model(GPT2LMHeadModel(config), adapters)
    with torch.no_grad():  # peft starts B at zero; make it non-zero so A's gradient is not zero in the first step
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model


def lora_loss(model: nn.Module, kind: str, tokens: Tensor) -> Tensor:
    out = model(tokens) if kind == "hand" else model(input_ids=tokens)
    logits = out if isinstance(out, Tensor) else out.logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def lora_batches(steps: int, global_batch: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=generator) for _ in range(steps)]
