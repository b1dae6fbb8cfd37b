"""Rank functions for the DCP interchange tests, run by ``zero_strategy.testing.run_ranks`` on forked gloo ranks:
an FSDP2 run (torch's ``fully_shard`` on a CPU device mesh) next to the ZeRO engine of ckpt_workers, both
training the same TiedLM on the same global batches with AdamW."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from ckpt_workers import GLOBAL_BATCH, INFO, build, full_state, make_optimizer, train_steps, trainer_state
from helpers.compare import assert_state_close
from helpers.models import lm_loss, make_batches, make_model, rank_slice
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

STEPS, SAVE_AT = 5, 2  # train SAVE_AT AdamW steps, checkpoint, then STEPS - SAVE_AT more (3)


def batches() -> list[list[Tensor]]:
    return make_batches(STEPS, 1, GLOBAL_BATCH)


# ------------------------------------------------------------------------------------------------------ FSDP2
def fsdp2_model(world: int, seed: int = 0) -> nn.Module:
    """TiedLM sharded by FSDP2: each block its own FSDP unit, the rest (embedding tied to the head) the root's."""
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed=seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: list[list[Tensor]], rank: int, world: int):
    for micro in steps:
        optimizer.zero_grad()
        for tokens in micro:
            (lm_loss(model, rank_slice(tokens, rank, world)) / len(micro)).backward()
        optimizer.step()


def fsdp2_full_state(model: nn.Module) -> dict[str, Tensor]:
    return {key: value.full_tensor().detach().clone() for key, value in model.state_dict().items()}


def fsdp2_save_then_train(rank: int, world: int, path: str, layout: str = "fsdp2") -> dict[str, dict[str, Tensor]]:
    """Train SAVE_AT steps, write a DCP checkpoint as FSDP2 users do (``layout="fsdp2"``: ``{"model", "optim"}``),
    as torchtitan does (``"torchtitan"``: model keys at the top level, ``optimizer`` flattened) or as Lightning's
    ModelParallelStrategy does (``"lightning"``: ``{"state_dict", "optimizer_0"}`` and a ``meta.pt`` of trainer
    state), train on; return the full state at the save and at the end."""
    model = fsdp2_model(world)
    optimizer = make_optimizer("adamw", model.parameters())
    fsdp2_train(model, optimizer, batches()[:SAVE_AT], rank, world)
    model_state, optim_state = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    if layout == "fsdp2":
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    elif layout == "torchtitan":  # model keys at the top level, the optimizer flattened per parameter
        flat_optim = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        dcp.save({**model_state, "optimizer": flat_optim}, checkpoint_id=path)
    else:
        dcp.save({"state_dict": model_state, "optimizer_0": optim_state}, checkpoint_id=path)
        if rank == 0:
            torch.save(
                {"global_step": SAVE_AT, "epoch": 0, "pytorch-lightning_version": "2.6.6", "lr_schedulers": []},
                Path(path) / "meta.pt",
            )
    at_save = fsdp2_full_state(model)
    fsdp2_train(model, optimizer, batches()[SAVE_AT:], rank, world)
    return {"at_save": at_save, "final": fsdp2_full_state(model)}


def fsdp2_resume(rank: int, world: int, path: str, with_optimizer: bool = True) -> dict[str, Tensor]:
    """A fresh FSDP2 model (other initial weights) loads the DCP checkpoint at ``path`` with torch's own API and
    trains the remaining steps."""
    model = fsdp2_model(world, seed=7)
    optimizer = make_optimizer("adamw", model.parameters())
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if not with_optimizer:
        del state["optim"]
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    fsdp2_train(model, optimizer, batches()[SAVE_AT:], rank, world)
    return fsdp2_full_state(model)


# ------------------------------------------------------------------------------------------------------- ZeRO
def zero_save_then_train(
    rank: int, world: int, stage: int, path: str, online: str | None = None, layout: dict[str, Any] | None = None
) -> dict[str, Tensor]:
    """Train SAVE_AT steps, save our own format at ``path`` (and, with ``online``, a DCP checkpoint there through
    ``checkpoint_format="dcp"``'s writer), train on; return the final full state."""
    from zero_strategy.checkpoint.dcp.save import save_dcp
    from zero_strategy.checkpoint.sharded.save import save_sharded

    model, optimizer, engine = build(stage, layout=layout)
    train_steps(model, optimizer, engine, batches()[:SAVE_AT])
    save_sharded(engine, path, trainer_state(SAVE_AT), INFO)
    if online is not None:
        save_dcp(engine, online, trainer_state(SAVE_AT), INFO)
    train_steps(model, optimizer, engine, batches()[SAVE_AT:])
    return full_state(model, engine)


def zero_resume_from_dcp(rank: int, world: int, stage: int, path: str, with_optimizer: bool = True) -> dict:
    """Our engine (other initial weights) resumes from the DCP checkpoint at ``path`` and trains on."""
    from zero_strategy.checkpoint.dcp.load import load_dcp

    model, optimizer, engine = build(stage, seed=7)
    state = load_dcp(engine, path, with_optimizer=with_optimizer)
    train_steps(model, optimizer, engine, batches()[SAVE_AT:])
    return {"final": full_state(model, engine), "trainer_state": state}


def assert_close(got: dict[str, Tensor], ref: dict[str, Tensor], tolerance: float, what: str) -> None:
    """Same keys, shapes and dtypes, every value finite on both sides, each tensor within ``tolerance`` of ``ref``
    relative to its largest value (helpers.compare, shared by every parity test)."""
    assert_state_close(got, ref, rel=tolerance, what=what)
