"""Character-level data for the GPT example: a text file, a fixed vocabulary, fixed-length windows."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class CharWindows(Dataset[tuple[Tensor, Tensor]]):
    """Windows of ``block_size`` characters every ``stride`` positions; the target is the window shifted by one."""

    def __init__(self, tokens: Tensor, block_size: int, stride: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(f"{tokens.numel()} characters cannot fill one window of block_size={block_size} (+1).")
        self.tokens = tokens  # 1-D int64, the whole split
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(LightningDataModule):
    """A text corpus split into train (head) and validation (tail) by character position.

    The vocabulary (sorted unique characters) is known right after construction, because the model needs
    ``vocab_size`` before the Trainer starts. Training windows start at every character (stride 1, shuffled by
    the distributed sampler); validation windows do not overlap (stride ``block_size``), so each validation
    character is scored once.
    """

    def __init__(
        self, path: str | Path, block_size: int, batch_size: int, val_fraction: float, num_workers: int = 0
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must be strictly between 0 and 1.")
        text = Path(path).read_text(encoding="utf-8")
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        tokens = self.encode(text)
        n_train = int(len(tokens) * (1.0 - val_fraction))
        self.train_tokens = tokens[:n_train]
        self.val_tokens = tokens[n_train:]
        # Checked here, not in setup(), so a bad split fails before any rank starts.
        for split, part in (("train", self.train_tokens), ("validation", self.val_tokens)):
            if part.numel() < block_size + 1:
                raise ValueError(
                    f"val_fraction={val_fraction} leaves {part.numel()} {split} characters; "
                    f"one window needs block_size + 1 = {block_size + 1}."
                )
        self.train_set: CharWindows | None = None
        self.val_set: CharWindows | None = None

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters in the corpus."""
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """String -> 1-D int64 tensor of character ids (every character must be in the vocabulary)."""
        return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        """1-D tensor of character ids -> string."""
        return "".join(self.chars[i] for i in ids.tolist())

    def setup(self, stage: str) -> None:
        """Build the window datasets (cheap views of the token tensors; same on every rank)."""
        self.train_set = CharWindows(self.train_tokens, self.block_size, stride=1)
        self.val_set = CharWindows(self.val_tokens, self.block_size, stride=self.block_size)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Shuffled full batches; Lightning swaps in a ``DistributedSampler`` so ranks see disjoint windows."""
        assert self.train_set is not None, "setup() has not run"
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Validation windows in order."""
        assert self.val_set is not None, "setup() has not run"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
