"""litgpt's own ``pretrain.main`` and ``finetune/full.main`` driven on a Fabric made by the test, on forked ranks.

As litgpt's own tests do: a tiny model config built in code, data loaders of random tokens instead of a data
module, ``torch.compile`` patched out (CPU), and the helpers that need packages outside litgpt's core
(``save_hyperparameters`` reads the command line with jsonargparse; the tokenizer reads files) replaced. Every
patch is made inside the rank process (run_ranks forks it), so the test process stays untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

SEQ = 16  # tokens per sample (the model's max_seq_length)
VOCAB = 96


def tiny_config() -> Any:
    from litgpt import Config

    return Config(name="tiny-neox", block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4,
                  n_embd=32, rotary_percentage=0.25, parallel_residual=True, bias=True)


class ResumableLoader(DataLoader):
    """A data loader whose position is part of the checkpoint (litgpt's real ones are litdata's stateful loaders): a
    resumed run continues at the batch where the saved one stopped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen = 0
        self.skip = 0

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        for index, batch in enumerate(super().__iter__()):
            self.seen = index + 1
            if index >= skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = self.seen = state["seen"]


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _pretrain_loaders(fabric: Fabric, micro_batch: int) -> tuple[DataLoader, DataLoader]:
    world, rank = fabric.world_size, fabric.global_rank
    train = _tokens(32, 0)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=False)
    train_loader = ResumableLoader(train, batch_size=micro_batch, sampler=sampler)
    val = _tokens(8, 1)
    val_loader = DataLoader(val, batch_size=micro_batch, sampler=DistributedSampler(val, world, rank, shuffle=False))
    return train_loader, val_loader  # pretrain.main sets them up


def _patch_litgpt(module: Any) -> None:
    """What litgpt's tests patch too, made inside this (forked) rank."""
    torch.compile = lambda model, *args, **kwargs: model  # type: ignore[assignment]  # CPU: no inductor here
    module.save_hyperparameters = lambda *args, **kwargs: None  # needs jsonargparse and the command line



def make_fabric(strategy: Any, world_size: int) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size, precision="32-true")
    fabric.launch()
    return fabric


def pretrain(fabric: Fabric, out_dir: Path, optimizer: dict, resume: Path | bool = False,
             max_steps: int = 4) -> dict[str, torch.Tensor]:
    """litgpt's ``pretrain.main``: 2 micro-batches per step (``no_backward_sync`` on the first), clipping at 1.0, a
    cosine schedule, a checkpoint every 2 steps and a final ``lit_model.pth``. Returns the trained weights."""
    import litgpt.pretrain as module
    from litgpt.args import EvalArgs, TrainArgs

    _patch_litgpt(module)
    micro_batch = 2
    module.get_dataloaders = lambda fabric, *args, **kwargs: _pretrain_loaders(fabric, micro_batch)
    world = fabric.world_size
    accumulation = 2
    train = TrainArgs(save_interval=2, log_interval=100, global_batch_size=micro_batch * accumulation * world,
                      micro_batch_size=micro_batch, lr_warmup_steps=1, max_norm=1.0, min_lr=0.0,
                      max_tokens=max_steps * accumulation * micro_batch * SEQ * world)
    evaluation = EvalArgs(interval=1000, max_iters=1, initial_validation=False, final_validation=False)
    module.main(fabric, devices=world, seed=7, initial_checkpoint_dir=None, resume=resume, config=tiny_config(),
                data=None, out_dir=out_dir, tokenizer_dir=None, tokenizer=None, train=train, eval=evaluation,
                optimizer=optimizer)
    return _weights(fabric, out_dir / "final" / "lit_model.pth")


class _Tokenizer:
    eos_id = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _sft_batches(count: int, seed: int) -> list[dict[str, Any]]:
    tokens = _tokens(count, seed)[:, :SEQ]  # the model attends to at most SEQ tokens
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    input_ids = torch.stack([s["input_ids"] for s in samples])
    counts = torch.full((len(samples),), input_ids.shape[1])
    return {"input_ids": input_ids, "labels": torch.stack([s["labels"] for s in samples]),
            "token_counts": {"raw": counts, "raw_plus_prompt_template": counts}}


def _finetune_loaders(fabric: Fabric, micro_batch: int) -> tuple[DataLoader, DataLoader]:
    world, rank = fabric.world_size, fabric.global_rank
    train, val = _sft_batches(16, 2), _sft_batches(4, 3)
    loaders = [DataLoader(data, batch_size=micro_batch, collate_fn=_collate,
                          sampler=DistributedSampler(data, world, rank, shuffle=False)) for data in (train, val)]
    return fabric.setup_dataloaders(*loaders)


def finetune(fabric: Fabric, checkpoint_dir: Path, out_dir: Path, optimizer: dict) -> dict[str, torch.Tensor]:
    """litgpt's ``finetune/full.main`` from ``checkpoint_dir/lit_model.pth`` (loaded by litgpt's own
    ``load_checkpoint``: ``model.load_state_dict`` for any strategy but FSDP): 2 micro-batches per step, 3 steps, a
    warm-up then cosine LR schedule, and the final ``fabric.save(path, {"model": model})``."""
    import litgpt.finetune.full as module
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.prompts import Default

    _patch_litgpt(module)
    micro_batch = 2
    module.Tokenizer = _Tokenizer
    module.get_dataloaders = lambda fabric, *args, **kwargs: _finetune_loaders(fabric, micro_batch)
    world = fabric.world_size
    train = TrainArgs(save_interval=None, log_interval=100, global_batch_size=micro_batch * 2 * world,
                      micro_batch_size=micro_batch, lr_warmup_steps=1, epochs=2, max_steps=3, max_seq_length=SEQ)
    evaluation = EvalArgs(interval=1000, max_iters=1, initial_validation=False, final_validation=False,
                          max_new_tokens=4)
    data = type("Data", (), {"prompt_style": Default()})()
    module.main(fabric, devices=world, resume=False, seed=11, config=tiny_config(), data=data,
                checkpoint_dir=checkpoint_dir, out_dir=out_dir, train=train, eval=evaluation, optimizer=optimizer)
    return _weights(fabric, out_dir / "final" / "lit_model.pth")


def _weights(fabric: Fabric, saved: Path) -> dict[str, torch.Tensor]:
    """The final weights as a plain litgpt ``GPT`` loads them from the saved ``lit_model.pth``: the file itself (DDP,
    ``state_dict_type="full"``), or the sharded directory consolidated by ``zero-to-fp32``."""
    fabric.barrier()
    from litgpt import GPT

    if saved.is_dir():
        from zero_strategy import consolidate

        saved = consolidate(saved, saved.parent / f"rank{fabric.global_rank}-consolidated.pt")
    content = torch.load(saved, weights_only=False, map_location="cpu")  # Fabric DDP's file holds the loader too
    model = GPT(tiny_config())
    model.load_state_dict(content.get("model", content))
    return {key: value.detach().clone() for key, value in model.state_dict().items()}
