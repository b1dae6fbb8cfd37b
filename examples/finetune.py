"""Fine-tune a larger GPT with ZeRO-3, CPU offload and activation checkpointing — a script to copy.

    python examples/finetune.py                                    # ~14 M parameters, 2 CPU ranks
    python examples/finetune.py --init outputs/model.safetensors   # start from consolidated weights
    python examples/finetune.py --accelerator gpu --devices 8 --precision bf16-mixed

It shows the memory levers working together: parameters, gradients and optimizer state sharded over the ranks
(stage 3), the fp32 masters and AdamW state in host memory (offload, the optimizer steps on the CPU), each
transformer ``Block`` recomputed in backward instead of keeping its activations, and the first layers frozen as in
a typical fine-tune. At the end the sharded checkpoint is consolidated into one plain ``.safetensors`` file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import zero_strategy  # noqa: E402
from examples.data import CharDataModule  # noqa: E402
from examples.gpt import GPT, Block, GPTConfig  # noqa: E402

CORPUS = REPO_ROOT / "examples" / "data" / "corpus.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", type=Path, help="consolidated weights (.safetensors/.pt) of the same architecture")
    parser.add_argument("--out", type=Path, default=Path("finetune_out"), help="checkpoint and output folder")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze-blocks", type=int, default=2, help="freeze embeddings and the first N blocks")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed or 16-mixed")
    parser.add_argument("--tiny", action="store_true", help="a very small model (CI smoke run)")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace, vocab_size: int) -> GPT:
    if args.tiny:
        config = GPTConfig(vocab_size=vocab_size, block_size=32, n_layer=3, n_head=2, n_embd=32, warmup_steps=0)
    else:
        config = GPTConfig(vocab_size=vocab_size, block_size=128, n_layer=8, n_head=6, n_embd=384, warmup_steps=5,
                           learning_rate=3e-4)
    model = GPT(config)
    if args.init is not None:
        model.load_state_dict(load_weights(args.init))
    # A fine-tune: the embeddings and the lower blocks stay as they are (ZeRO never steps frozen parameters).
    frozen = [model.pos_emb, *model.blocks[: args.freeze_blocks]]
    for module in frozen:
        module.requires_grad_(False)
    return model


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    seed_everything(0)
    block_size = 32 if args.tiny else 128
    data = CharDataModule(CORPUS, block_size=block_size, batch_size=8, val_fraction=0.1)
    model = build_model(args, data.vocab_size)
    strategy = zero_strategy.ZeroStrategy(
        stage=3,
        start_method="spawn",
        offload_optimizer="cpu",  # fp32 masters, gradients and AdamW state in host memory
        offload_param="cpu",  # parameter slices wait in host memory between gathers
        activation_checkpointing=[Block],  # recompute each block in backward
        unit_modules=["Block"],  # one block gathered at a time
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        limit_val_batches=4,
        val_check_interval=args.steps,
        default_root_dir=str(args.out),
        # every rank writes its shard of last.ckpt (a directory) when training ends
        callbacks=[ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0)],
        logger=False,
    )
    trainer.fit(model, datamodule=data)
    output = zero_strategy.consolidate(args.out / "last.ckpt", args.out / "finetuned.safetensors", progress=False)
    print(f"fine-tuned weights: {output}", flush=True)
    return output


if __name__ == "__main__":
    main()
