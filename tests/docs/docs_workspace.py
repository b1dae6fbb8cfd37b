"""The directory the docs' runnable shell blocks start in, made the way the docs say a user makes it: a Hugging Face
GPT-2 (tiny) held as ``self.model`` in a LightningModule, trained one step under ``zero3`` by the Trainer, with
``ModelCheckpoint(save_last=True)`` writing ``checkpoints/last.ckpt``, and the model's ``config.json`` in
``base-model/`` (what ``zero-to-fp32 --hf --hf-config base-model/`` reads).

Run as a script (``python docs_workspace.py DIR``) in a process of its own: the fit leaves a process group behind,
which a test process must not inherit."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import zero_strategy  # noqa: F401  (registers "zero3")

VOCAB, SEQ = 64, 16


class HfInLightning(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                            eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Any:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(directory: str) -> None:
    os.chdir(directory)
    torch.manual_seed(0)
    module = HfInLightning()
    module.model.config.save_pretrained("base-model")
    trainer = pl.Trainer(strategy="zero3", accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath="checkpoints", save_last=True)])
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=2))


if __name__ == "__main__":
    main(sys.argv[1])
