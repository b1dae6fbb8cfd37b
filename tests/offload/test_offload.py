"""Offload: exact parity with no offload (cpu and nvme, every stage), chunked nvme steps, memory, clear errors."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zero_strategy import ZeroConfig, ZeroConfigError, ZeroEngine
from zero_strategy.core.flat.placement import NvmeStore, OffloadError
from zero_strategy.process_memory import reset_peak, status_bytes
from zero_strategy.testing import run_ranks


class Net(nn.Module):
    def __init__(self, width: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def train(rank: int, world: int, stage: int, options: dict, optimizer: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, min_unit_numel=10**9, **options))
    data = torch.randn(4, 2, 8, 48, generator=torch.Generator().manual_seed(1))
    per = 8 // world
    for step in data:
        opt.zero_grad()
        for micro in step:
            (model(micro[rank * per : (rank + 1) * per]).pow(2).mean() / 2).backward()
        engine.optimizer_step(opt)
    engine.release()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_offload_is_exact_at_every_stage(tmp_path: Path, optimizer: str) -> None:
    for stage in (1, 2, 3):
        reference = run_ranks(train, 2, stage, {}, optimizer, timeout_s=60)[0]
        variants = [
            {"offload_optimizer": "cpu"},
            # chunks of 1024 elements split every 48x48 weight: the chunked step must equal the whole one
            {"offload_optimizer": "nvme", "nvme_path": str(tmp_path / f"s{stage}"), "nvme_chunk_numel": 1024},
        ]
        if stage == 3:
            variants.append({"offload_optimizer": "cpu", "offload_param": "cpu"})
            variants.append(
                {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(tmp_path / "p"),
                 "nvme_chunk_numel": 1024}
            )
        for options in variants:
            got = run_ranks(train, 2, stage, options, optimizer, timeout_s=60)[0]
            for key, value in reference.items():
                assert torch.equal(got[key], value), (stage, options, key)
    # teardown removed every offload file
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_offload_config_errors_name_the_key() -> None:
    with pytest.raises(ZeroConfigError, match="offload_param"):
        ZeroConfig(stage=2, offload_param="cpu")
    with pytest.raises(ZeroConfigError, match="nvme_path"):
        ZeroConfig(offload_optimizer="nvme")
    with pytest.raises(ZeroConfigError, match="offload_optimizer"):
        ZeroConfig(offload_optimizer="tape")


def test_unwritable_or_full_nvme_path_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadError, match="not a writable directory"):
        NvmeStore(blocker / "sub", rank=0)
    with pytest.raises(OffloadError, match="GiB free"):
        NvmeStore.check_space(tmp_path, 2**62)


def peak_training_rss(rank: int, world: int, options: dict) -> int:
    """Peak resident bytes above the pre-model baseline while training (after sharding), fp32 AdamW.

    glibc raises its mmap threshold after the first large free, after which freed multi-MB buffers stay in the
    heap and RSS only grows; a fixed threshold makes RSS track what is really alive, for both runs alike."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    baseline = status_bytes("VmRSS")
    torch.manual_seed(0)
    # 33.6 M parameters (134 MB): optimizer state dominates the constant per-process and per-unit overheads
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(32)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, min_unit_numel=2**20, **options))
    if engine.placement is not None and engine.placement.store is not None:
        engine.placement.store.release_pages()
    reset_peak()  # measure the training phase
    x = torch.randn(4, 1024)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        engine.optimizer_step(opt)
    peak = status_bytes("VmHWM") - baseline
    engine.release()
    return peak


def measure_in_fresh_process(function: str, *args: object) -> list[int]:
    """Run ``run_ranks(<function>, 2, *args)`` from a new interpreter: forked from a long-lived pytest process the
    ranks would inherit its heap and arenas, which adds a constant offset to every resident-memory figure."""
    code = (
        "import json, sys; from zero_strategy.testing import run_ranks; "
        f"from offload import {function.split('.')[0]} as m; "
        f"print(json.dumps(run_ranks(m.{function.split('.')[1]}, 2, *json.loads(sys.argv[1]), timeout_s=90)))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True,
                          timeout=110, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(240)
def test_nvme_offload_halves_resident_memory_of_an_optimizer_heavy_model(tmp_path: Path) -> None:
    plain = measure_in_fresh_process("test_offload.peak_training_rss", {})
    nvme = measure_in_fresh_process(
        "test_offload.peak_training_rss",
        {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(tmp_path), "nvme_chunk_numel": 2**18},
    )
    for rank in range(2):
        assert nvme[rank] <= 0.5 * plain[rank], (plain, nvme)


def train_with_checkpoint(rank: int, world: int, options: dict, path: str, mode: str) -> dict[str, torch.Tensor]:
    """4 AdamW steps; mode "save" checkpoints after step 2, "load" starts from that checkpoint."""
    from zero_strategy.checkpoint.base.format import PARAM_GROUPS_KEY
    from zero_strategy.checkpoint.sharded.load import check_compatible, load_optimizer_state, load_weights
    from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
    from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=3, min_unit_numel=10**9, **options))
    data = torch.randn(4, 8, 48, generator=torch.Generator().manual_seed(1))
    start = 0
    if mode == "load":
        with ShardedCheckpoint(path) as ckpt:
            check_compatible(engine, ckpt, strict=True, with_optimizer=True)
            load_weights(engine, ckpt)
            load_optimizer_state(engine, ckpt, ckpt.trainer_state()[PARAM_GROUPS_KEY])
        start = 2
    for index in range(start, 4):
        if mode == "save" and index == 2:
            save_sharded(engine, path, {"optimizer_states": []}, SaveInfo("32-true", {}, {}))
        opt.zero_grad()
        model(data[index][rank * 4 : (rank + 1) * 4]).pow(2).mean().backward()
        engine.optimizer_step(opt)
    engine.release()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
def test_offloaded_runs_save_and_resume_exactly(tmp_path: Path) -> None:
    """A checkpoint written by an nvme-offloaded run resumes bit-identically offloaded (nvme or cpu) and plain."""
    nvme = {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(tmp_path / "files"),
            "nvme_chunk_numel": 1024}
    path = str(tmp_path / "ck")
    uninterrupted = run_ranks(train_with_checkpoint, 2, nvme, path, "save", timeout_s=60)[0]
    for options in (nvme, {"offload_optimizer": "cpu"}, {}):
        resumed = run_ranks(train_with_checkpoint, 2, options, path, "load", timeout_s=60)[0]
        for key, value in uninterrupted.items():
            assert torch.equal(resumed[key], value), (options, key)


def gradient_slices_worker(rank: int, world: int, nvme_path: str) -> dict[str, bool]:
    """After a backward under nvme optimizer offload, where do the reduced gradient slices live?"""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ZeroConfig(stage=3, min_unit_numel=10**9, offload_optimizer="nvme", offload_param="nvme",
                        nvme_path=nvme_path)  # fmt: skip
    engine = ZeroEngine(model, [opt], config)
    store = engine.placement.store
    model(torch.randn(4, 48)).pow(2).mean().backward()
    pieces = [piece for flat in engine.flat_params for piece in flat.master_pieces]
    grads = [piece.grad for piece in pieces if piece.grad is not None]
    out = {"some": bool(grads), "in_files": all(store.holds(grad) for grad in grads)}
    engine.optimizer_step(opt)
    out["state_in_files"] = all(store.holds(v) for state in opt.state.values() for v in state.values() if v.dim() > 0)
    engine.release()
    return out


@pytest.mark.timeout(60)
def test_nvme_offload_keeps_gradient_slices_in_files(tmp_path: Path) -> None:
    for rank, out in enumerate(run_ranks(gradient_slices_worker, 2, str(tmp_path), timeout_s=40)):
        assert out["some"] and out["in_files"], f"rank {rank}: gradient slices in host memory ({out})"
        assert out["state_in_files"], f"rank {rank}: optimizer state in host memory"
