"""Writes the DeepSpeed checkpoints the tests read, and what DeepSpeed itself does after loading each.

Runs only in a separate virtualenv that has DeepSpeed (the test suite never imports it): see README.md beside
this file. Every fixture is a small model with a tied weight, a frozen layer and two param groups, trained for
two steps and saved; DeepSpeed then loads it in fresh processes of the same world size and runs three more
steps, and ``record.json`` keeps the losses, learning rates, step counters and final fp32 weights of those three
steps (consolidated by DeepSpeed's own ``zero_to_fp32``), plus DeepSpeed's ``zero_to_fp32`` output of the saved
checkpoint itself (``<name>/zero_to_fp32.pt``).

The global batch of every step is the same whatever the world size (each rank takes its rows), so a resume at
another world size can be held to the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
VOCAB, WIDTH, SEQ, GLOBAL_BATCH = 11, 6, 5, 4
SAVED_AT = 2  # optimizer steps before the save
CONTINUED = 3  # steps DeepSpeed runs after loading


class TinyLM(nn.Module):
    """Tied embedding / output weight, a frozen layer, odd sizes (DeepSpeed pads them), one buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Each layer's input in its own dtype: DeepSpeed's bf16/fp16 modes do not cast every tensor alike
        # (frozen parameters, buffers), and a CPU matmul refuses mixed dtypes.
        h = self.embed(tokens[:, :-1])
        h = torch.tanh(self.body(h.to(self.body.weight.dtype)))
        h = h + self.frozen(h.to(self.frozen.weight.dtype)).to(h.dtype)
        h = self.norm(h.to(self.norm.weight.dtype)) * self.gain.to(h.dtype)
        logits = self.head(h.to(self.head.weight.dtype))
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups: the tied matrix and the body's weight; the rest (biases, norm) with other hyper-parameters."""
    first = [model.embed.weight, model.body.weight]
    rest = [model.body.bias, model.norm.weight, model.norm.bias]
    return [{"params": first, "lr": 0.05, "weight_decay": 0.0}, {"params": rest, "lr": 0.02, "weight_decay": 0.1}]


def global_batch(step: int) -> torch.Tensor:
    """The tokens of optimizer step ``step`` (0-based), whatever the world size."""
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def rank_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = GLOBAL_BATCH // world_size
    return batch[rank * per : (rank + 1) * per]


def ds_config(stage: int, precision: str, world_size: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":  # a small initial scale: no overflow, so no skipped step, in the recorded run
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
    return config


def build_engine(stage: int, precision: str, world_size: int) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(stage, precision, world_size)
    )
    return engine


def train_step(engine: Any, step: int, rank: int, world_size: int) -> float:
    loss = engine(rank_rows(global_batch(step), rank, world_size))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().clone()
    torch.distributed.all_reduce(mean)
    return float(mean) / world_size


def adam_step(engine: Any) -> float:
    """The AdamW step counter DeepSpeed's inner optimizer holds (every state of it has the same)."""
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    for state in inner.state.values():
        step = state.get("step")
        if step is not None:
            return float(step)
    raise RuntimeError("no optimizer state")


def consolidated(directory: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(directory).items()}


def loss_scaler_state(engine: Any) -> dict[str, Any] | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or not engine.fp16_enabled():
        return None
    return {k: getattr(scaler, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")}


# --------------------------------------------------------------------------------------------- plain engine
def plain_save(rank: int, world_size: int, stage: int, precision: str, directory: str,
               for_universal: bool = False) -> dict[str, Any]:
    engine = build_engine(stage, precision, world_size)
    losses = [train_step(engine, step, rank, world_size) for step in range(SAVED_AT)]
    # ds_to_universal insists on this client-state entry (Megatron-DeepSpeed writes it); empty: no tensor
    # parallelism to describe
    engine.save_checkpoint(directory, client_state={"universal_checkpoint_info": {}} if for_universal else {})
    return {"losses_before_save": losses, "loss_scaler_at_save": loss_scaler_state(engine)}


def plain_continue(rank: int, world_size: int, stage: int, precision: str, directory: str,
                   universal: bool = False) -> dict[str, Any]:
    engine = build_engine(stage, precision, world_size)
    if universal:
        engine._config.load_universal_checkpoint = True
    engine.load_checkpoint(directory, load_optimizer_states=True, load_lr_scheduler_states=True)
    record: dict[str, Any] = {"global_steps_at_load": engine.global_steps, "lr_at_load": engine.get_lr(),
                              "loss_scaler_at_load": loss_scaler_state(engine)}
    losses, lrs = [], []
    for step in range(SAVED_AT, SAVED_AT + CONTINUED):
        lrs.append(engine.get_lr())
        losses.append(train_step(engine, step, rank, world_size))
    record.update(losses=losses, lrs=lrs, lr_after=engine.get_lr(), global_steps=engine.global_steps,
                  adam_step=adam_step(engine), loss_scaler_after=loss_scaler_state(engine))
    with tempfile.TemporaryDirectory() if rank == 0 else _no_dir() as scratch:
        where = [scratch]
        torch.distributed.broadcast_object_list(where)
        engine.save_checkpoint(where[0])
        torch.distributed.barrier()
        if rank == 0:
            record["final_weights"] = {k: v.float().flatten().tolist() for k, v in consolidated(where[0]).items()}
        torch.distributed.barrier()
    return record


class _no_dir:
    def __enter__(self) -> str:
        return ""

    def __exit__(self, *exc: object) -> None:
        return None


# ------------------------------------------------------------------------------------------------ Lightning
def lightning_run(rank: int, world_size: int, stage: int, precision: str, directory: str, resume: bool,
                  ) -> dict[str, Any]:
    """A LightningModule fit with Lightning's DeepSpeedStrategy (its CUDA-only check lifted: this only writes
    files): two steps then a ModelCheckpoint save, or a resume from that save for three more steps."""
    import lightning.pytorch as pl
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed
    from lightning.pytorch.strategies import DeepSpeedStrategy

    DeepSpeedStrategy.setup_environment = pl.strategies.DDPStrategy.setup_environment  # type: ignore[method-assign]
    lightning_deepspeed._validate_device_index_selection = lambda devices: None  # CUDA indices: none on a CPU
    import deepspeed

    initialize = deepspeed.initialize

    def initialize_on_cpu(*args: Any, **kwargs: Any) -> Any:  # Lightning passes the device index: None on a CPU
        if getattr(kwargs.get("args"), "device_rank", 0) is None:
            kwargs["args"].device_rank = -1
        return initialize(*args, **kwargs)

    deepspeed.initialize = initialize_on_cpu

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLM()
            self.seen: list[tuple[float, float]] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.model(batch[0])
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)
            self.seen.append((float(mean) / world_size, self.trainer.optimizers[0].param_groups[0]["lr"]))
            return loss

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(param_groups(self.model), betas=(0.9, 0.95), eps=1e-8)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Steps(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4 * world_size  # 4 micro-batches of one sample per rank and epoch

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.zeros(1)

    class Batches(torch.utils.data.Dataset):  # one whole per-rank micro-batch per item, step by step
        def __init__(self) -> None:
            self.items = [rank_rows(global_batch(step), rank, world_size) for step in range(SAVED_AT + CONTINUED)]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, index: int) -> torch.Tensor:
            return self.items[index]

    from lightning.pytorch.callbacks import ModelCheckpoint

    module = Module()
    loader = torch.utils.data.DataLoader(Batches(), batch_size=1, shuffle=False)
    config = ds_config(stage, precision, world_size)
    config.pop("train_batch_size")
    config.pop("gradient_accumulation_steps")  # Lightning sets it from the Trainer
    config["train_micro_batch_size_per_gpu"] = 1  # Lightning's batch: one item = one rank's rows
    strategy = DeepSpeedStrategy(config=config, process_group_backend="gloo")
    saver = ModelCheckpoint(dirpath=directory, filename="step{step}", auto_insert_metric_name=False,
                            every_n_train_steps=SAVED_AT, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=SAVED_AT + CONTINUED if resume else
        SAVED_AT, callbacks=[saver] if not resume else [], logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, precision={"fp32": "32-true",
        "bf16": "bf16-mixed", "fp16": "16-mixed"}[precision], enable_checkpointing=not resume,
    )
    ckpt = str(Path(directory) / f"step{SAVED_AT}.ckpt") if resume else None
    trainer.fit(module, loader, ckpt_path=ckpt)
    return {"losses": [loss for loss, _ in module.seen], "lrs": [lr for _, lr in module.seen],
            "global_step": trainer.global_step}


# -------------------------------------------------------------------------------------------------- runner
def _worker(rank: int, world_size: int, port: int, jobs: list[dict[str, Any]], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for job in jobs:
        kind = job.pop("kind")
        results.append({"plain_save": plain_save, "plain_continue": plain_continue}[kind](rank, world_size, **job))
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _lightning_worker(world_size: int, port: int, job: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = lightning_run(int(os.environ.get("LOCAL_RANK", 0)), world_size, **job)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        Path(out).write_text(json.dumps(result))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(world_size: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "out.json")
        mp.spawn(_worker, args=(world_size, free_port(), jobs, out), nprocs=world_size, join=True)
        return list(json.loads(Path(out).read_text()))


PLAIN = [(stage, precision, ws) for ws in (1, 2) for stage in (1, 2, 3) for precision in ("fp32", "bf16", "fp16")]
LIGHTNING = [(stage, "fp32", 2) for stage in (1, 2, 3)] + [(2, "bf16", 2), (3, "bf16", 1)]
UNIVERSAL_FROM = (2, "fp32", 2)


def versions() -> dict[str, str]:
    import deepspeed
    import lightning

    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "lightning": lightning.__version__,
            "python": sys.version.split()[0]}


def tidy(directory: Path) -> None:
    """Drop what DeepSpeed copies beside a checkpoint that the tests do not read (its own script)."""
    for script in [*directory.glob("zero_to_*.py")]:
        script.unlink()


def make_plain(out: Path, stage: int, precision: str, world_size: int) -> dict[str, Any]:
    name = f"engine_z{stage}_{precision}_ws{world_size}"
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    ckpt = target / "ckpt"
    saved = spawn(world_size, [{"kind": "plain_save", "stage": stage, "precision": precision,
                                "directory": str(ckpt)}])[0]
    tidy(ckpt)
    torch.save(consolidated(str(ckpt)), target / "zero_to_fp32.pt")
    continued = spawn(world_size, [{"kind": "plain_continue", "stage": stage, "precision": precision,
                                    "directory": str(ckpt)}])[0]
    print(f"{name}: {continued['losses']}", flush=True)
    return {"name": name, "layout": "engine", "stage": stage, "precision": precision, "world_size": world_size,
            "checkpoint": f"{name}/ckpt", "zero_to_fp32": f"{name}/zero_to_fp32.pt", **saved,
            "continuation": continued}


def make_universal(out: Path, stage: int, precision: str, world_size: int) -> dict[str, Any]:
    name = f"universal_z{stage}_{precision}_ws{world_size}"
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    saved = spawn(world_size, [{"kind": "plain_save", "stage": stage, "precision": precision,
                                "directory": str(target / "ckpt"), "for_universal": True}])[0]
    tidy(target / "ckpt")
    torch.save(consolidated(str(target / "ckpt")), target / "zero_to_fp32.pt")
    tag = (target / "ckpt" / "latest").read_text().strip()
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(target / "ckpt" / tag), "--output_folder", str(target / "ckpt" / f"{tag}_universal"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1"], check=True)
    shutil.rmtree(target / "ckpt" / tag)  # the universal copy only (its `latest_universal` names it)
    (target / "ckpt" / "latest").unlink()
    continued = {}
    for ws in (1, 2):  # a universal checkpoint loads at any world size in DeepSpeed itself
        continued[str(ws)] = spawn(ws, [{"kind": "plain_continue", "stage": stage, "precision": precision,
                                         "directory": str(target / "ckpt"), "universal": True}])[0]
    print(f"{name}: {continued['1']['losses']}", flush=True)
    return {"name": name, "layout": "universal", "stage": stage, "precision": precision, "world_size": world_size,
            "checkpoint": f"{name}/ckpt", "zero_to_fp32": f"{name}/zero_to_fp32.pt", **saved,
            "continuation_by_world_size": continued}


def make_lightning(out: Path, stage: int, precision: str, world_size: int) -> dict[str, Any]:
    name = f"lightning_z{stage}_{precision}_ws{world_size}"
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    runs = {}
    for resume in (False, True):
        job = {"stage": stage, "precision": precision, "directory": str(target), "resume": resume}
        with tempfile.TemporaryDirectory() as scratch:
            result = Path(scratch) / "out.json"
            env = {**os.environ, "DS_ACCELERATOR": "cpu"}
            subprocess.run([sys.executable, __file__, "--lightning-job", json.dumps(job), "--out", str(result),
                            "--world-size", str(world_size)], check=True, env=env, cwd=scratch)
            runs["continuation" if resume else "first"] = json.loads(result.read_text())
    checkpoint = target / f"step{SAVED_AT}.ckpt"
    for stray in target.iterdir():
        if stray != checkpoint:
            shutil.rmtree(stray) if stray.is_dir() else stray.unlink()
    tidy(checkpoint)
    torch.save(consolidated(str(checkpoint)), target / "zero_to_fp32.pt")
    print(f"{name}: {runs['continuation']['losses']}", flush=True)
    return {"name": name, "layout": "lightning", "stage": stage, "precision": precision, "world_size": world_size,
            "checkpoint": f"{name}/{checkpoint.name}", "zero_to_fp32": f"{name}/zero_to_fp32.pt",
            "losses_before_save": runs["first"]["losses"], "continuation": runs["continuation"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--only", default="", help="comma-separated layouts: engine,universal,lightning")
    parser.add_argument("--case", action="append", default=[],
                        help="only this fixture, LAYOUT:STAGE:PRECISION:WORLD_SIZE (e.g. engine:2:bf16:2); repeatable")
    parser.add_argument("--lightning-job", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lightning_job:
        _lightning_worker(args.world_size, int(os.environ.get("MASTER_PORT") or free_port()),
                          json.loads(args.lightning_job), args.out)
        return
    assert os.environ.get("DS_ACCELERATOR") == "cpu", "run with DS_ACCELERATOR=cpu (see README.md)"
    out = Path(args.out)
    only = set(args.only.split(",")) if args.only else {"engine", "universal", "lightning"}
    record_path = out / "record.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"fixtures": {}}
    record["versions"] = versions()
    record["saved_at_step"], record["continued_steps"] = SAVED_AT, CONTINUED
    makers = [("engine", make_plain, PLAIN), ("universal", make_universal, [UNIVERSAL_FROM]),
              ("lightning", make_lightning, LIGHTNING)]
    for layout, make, cases in makers:
        if layout not in only:
            continue
        for case in cases:
            if args.case and f"{layout}:{case[0]}:{case[1]}:{case[2]}" not in args.case:
                continue
            entry = make(out, *case)
            record["fixtures"][entry["name"]] = entry
            record_path.write_text(json.dumps(record, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
