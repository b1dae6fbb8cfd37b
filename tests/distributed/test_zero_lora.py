"""LoRA / PEFT: frozen base weights and small trainable adapters inside the same blocks train like DDP at every
stage, hold gradients and optimizer state only for the adapters, and checkpoint (frozen weights included) into a
file that consolidates completely."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.lora import lora_batches, lora_loss, make_lora_model
from helpers.models import assert_state_close, clone_state
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import memory_report
from zero_strategy.testing import run_ranks

STEPS = 3
INFO = SaveInfo("32-true", {}, {"zero_strategy": "test", "torch": torch.__version__})


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2, weight_decay=0.1)


def _rows(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = tokens.shape[0] // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def _ddp_run(rank: int, world_size: int, kind: str) -> dict[str, torch.Tensor]:
    model = make_lora_model(kind)
    ddp = DistributedDataParallel(model)
    optimizer = _optimizer(model)
    for tokens in lora_batches(STEPS, 2 * world_size):
        optimizer.zero_grad()
        lora_loss(ddp, kind, _rows(tokens, rank, world_size)).backward()
        optimizer.step()
    return clone_state(model)


def _zero_run(rank: int, world_size: int, kind: str, stage: int, path: str | None) -> dict:
    model = make_lora_model(kind)
    optimizer = _optimizer(model)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    for tokens in lora_batches(STEPS, 2 * world_size):
        optimizer.zero_grad()
        lora_loss(model, kind, _rows(tokens, rank, world_size)).backward()
        with engine.step_window(optimizer):
            gradient_bytes = memory_report(engine).gradients
            optimizer.step()
    if path is not None:
        save_sharded(engine, path, {"optimizer_states": [{}], "global_step": STEPS, "epoch": 0}, INFO)
    with engine.gathered_parameters():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pieces = sum(len(flat.master_pieces) for flat in engine.flat_params)
    return {"state": state, "gradient_bytes": gradient_bytes, "state_bytes": memory_report(engine).optimizer_state,
            "pieces": pieces}


def _all_runs(rank: int, world_size: int, kind: str, path: str) -> dict:
    results = {"ddp": _ddp_run(rank, world_size, kind)}
    for stage in (1, 2, 3):
        results[stage] = _zero_run(rank, world_size, kind, stage, path if stage == 3 else None)
    return results


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["hand", "peft"])
def test_lora_matches_ddp_holds_adapter_state_only_and_consolidates(kind: str, tmp_path: Path) -> None:
    if kind == "peft":
        pytest.importorskip("peft")
    model = make_lora_model(kind)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert 0 < trainable < frozen / 4  # adapters are small next to the base
    initial = clone_state(model)
    world_size = 2
    results = run_ranks(_all_runs, world_size, kind, str(tmp_path / "ck"), timeout_s=80)
    reference = results[0]["ddp"]
    adapters = [k for k in reference if "lora" in k]
    assert adapters and all(not torch.equal(reference[k], initial[k]) for k in adapters)
    for stage in (1, 2, 3):
        runs = [r[stage] for r in results]
        for rank, run in enumerate(runs):
            got = {k: v for k, v in run["state"].items() if k in reference}
            assert_state_close(got, reference, rel=1e-5, what=f"{kind}, stage {stage}, rank {rank}")
        # every trainable element's fp32 gradient lives on exactly one rank, and nothing for the frozen base
        assert sum(run["gradient_bytes"] for run in runs) == 4 * trainable, (stage, trainable)
        # AdamW: exp_avg and exp_avg_sq per trainable element (fp32) plus one scalar step per master piece
        state_bytes = sum(run["state_bytes"] for run in runs)
        assert 8 * trainable <= state_bytes <= 8 * trainable + 4 * sum(run["pieces"] for run in runs), state_bytes
    full = results[0][3]["state"]
    consolidated = torch.load(consolidate(tmp_path / "ck", tmp_path / "model.pt", progress=False), weights_only=True)
    assert consolidated.keys() == full.keys()
    for key, value in full.items():  # the frozen base is in the file, with its (unchanged) values
        torch.testing.assert_close(consolidated[key], value.float() if value.is_floating_point() else value,
                                   rtol=0, atol=0, msg=key)
    frozen_keys = [k for k in initial if "lora" not in k and k in consolidated]
    assert frozen_keys and all(torch.equal(consolidated[k], initial[k]) for k in frozen_keys)
