"""The fine-tuning example (zero3 + CPU offload + activation checkpointing + frozen layers), with tiny settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import seed_everything
from safetensors.torch import load_file

from examples.data import CharDataModule
from examples.finetune import CORPUS, build_model, main, parse_args


@pytest.mark.timeout(150)
def test_finetune_trains_unfrozen_layers_and_writes_plain_weights(tmp_path: Path) -> None:
    output = main(["--tiny", "--steps", "3", "--out", str(tmp_path)])
    weights = load_file(str(output))
    seed_everything(0)
    vocab = CharDataModule(CORPUS, block_size=32, batch_size=8, val_fraction=0.1).vocab_size
    initial = build_model(parse_args(["--tiny"]), vocab).state_dict()
    assert list(weights) == list(initial)  # exactly the module's keys
    frozen = [k for k in initial if k.startswith(("pos_emb.", "blocks.0.", "blocks.1."))]
    trained = [k for k in initial if k.startswith("blocks.2.") and k.endswith("weight")]
    assert frozen and trained
    for key in frozen:
        assert torch.equal(weights[key], initial[key]), f"frozen {key} changed"
    assert any(not torch.equal(weights[k], initial[k]) for k in trained)
    # --init starts a new fine-tune from those consolidated weights
    restarted = build_model(parse_args(["--tiny", "--init", str(output)]), vocab)
    assert torch.equal(restarted.state_dict()["blocks.2.mlp.fc.weight"], weights["blocks.2.mlp.fc.weight"])
