"""A real Fabric client: litgpt's ``pretrain.main`` and ``finetune/full.main`` (litgpt 0.5.13, installed without its
dependencies: ``pip install --no-deps litgpt==0.5.13``) on 2 CPU ranks, under zero1/2/3 and under Fabric's DDP.

Pretraining builds the model with ``init_module(empty_init=True)`` and initializes it through its modules'
``reset_parameters()`` (``meta_init="reset_parameters"``, FSDP's contract), sets up module and optimizer apart,
accumulates 2 micro-batches through ``no_backward_sync``, clips at norm 1.0, saves every 2 steps and at the end;
fine-tuning loads a ``lit_model.pth`` through litgpt's own ``load_checkpoint`` (``model.load_state_dict``) and steps
an LR scheduler. Each ZeRO run must end with DDP's weights (SGD within 1e-5, AdamW within 1e-4), as a plain litgpt
``GPT`` loads them from the saved ``lit_model.pth`` (the file itself with ``state_dict_type="full"``, the sharded
directory through ``zero-to-fp32``); a run resumed from a step-2 checkpoint (at another stage) must end where the
uninterrupted run ended.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.models import assert_state_close

pytest.importorskip("litgpt", reason="litgpt is installed by `make setup` with `pip install --no-deps litgpt==0.5.13`")

from helpers.launched import as_launched_rank
from helpers.litgpt_runs import finetune, make_fabric, pretrain, tiny_config

from zero_strategy import ZeroFabricStrategy
from zero_strategy.testing import run_ranks

SGD = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.9}}
# eps=1e-5, not 1e-8: the gradient of the attention's key bias is zero in exact arithmetic (softmax does not change
# when every score of a query moves by the same q·b), so in float it is rounding noise, which Adam divides by its
# own root mean square: with eps=1e-8 those elements move by ±lr whatever the noise, differently under any other
# summation order (4e-3 relative between DDP and ZeRO here; SGD's 1e-5 parity shows the rest agrees).
ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-5}}
NAMES = ("ddp", "zero1", "zero2", "zero3")


def _strategy(name: str, full: bool) -> object:
    if name == "ddp":
        return "ddp"
    return ZeroFabricStrategy(stage=int(name[-1]), meta_init="reset_parameters",
                              state_dict_type="full" if full else "sharded")


def litgpt_runs(rank: int, world: int, root: str) -> dict:
    as_launched_rank(rank, world)
    base = Path(root)
    out: dict = {}
    for name in NAMES:
        out[("pretrain sgd", name)] = pretrain(make_fabric(_strategy(name, full=True), world),
                                               base / f"sgd-{name}", SGD)
        out[("pretrain adamw", name)] = pretrain(make_fabric(_strategy(name, full=False), world),
                                                 base / f"adamw-{name}", ADAMW)
    # resume zero3's step-2 checkpoint under zero2, in a fresh output directory
    resumed = base / "resumed"
    if rank == 0:
        (resumed / "step-00000002").mkdir(parents=True)
        shutil.copytree(base / "adamw-zero3" / "step-00000002" / "lit_model.pth",
                        resumed / "step-00000002" / "lit_model.pth")
    fabric = make_fabric(_strategy("zero2", full=False), world)
    fabric.barrier()
    out["resumed"] = pretrain(fabric, resumed, ADAMW, resume="auto")
    # fine-tune from a litgpt checkpoint (a plain state dict in lit_model.pth)
    checkpoint_dir = base / "pretrained"
    if rank == 0:
        from litgpt import GPT

        checkpoint_dir.mkdir()
        torch.manual_seed(3)
        torch.save(GPT(tiny_config()).state_dict(), checkpoint_dir / "lit_model.pth")
    for name in NAMES:
        fabric = make_fabric(_strategy(name, full=False), world)
        fabric.barrier()
        out[("finetune", name)] = finetune(fabric, checkpoint_dir, base / f"finetune-{name}", ADAMW)
    out["pretrained"] = torch.load(checkpoint_dir / "lit_model.pth", weights_only=True)
    return out


@pytest.mark.timeout(300)
def test_litgpt_pretrain_and_finetune_match_ddp(tmp_path: Path) -> None:
    got = run_ranks(litgpt_runs, 2, str(tmp_path), timeout_s=280)[0]
    assert (tmp_path / "sgd-zero3" / "final" / "lit_model.pth").is_file()  # state_dict_type="full": one file
    assert (tmp_path / "adamw-zero3" / "step-00000002" / "lit_model.pth" / "manifest.json").is_file()  # sharded
    for kind, rel in (("pretrain sgd", 1e-5), ("pretrain adamw", 1e-4), ("finetune", 1e-4)):
        for name in NAMES[1:]:
            assert_state_close(got[(kind, name)], got[(kind, "ddp")], rel=rel, what=f"{kind}, {name}")
    assert_state_close(got["resumed"], got[("pretrain adamw", "zero3")], rel=1e-6, what="resumed under zero2")
    trained = got[("finetune", "ddp")]
    assert any(not torch.equal(trained[k], v) for k, v in got["pretrained"].items() if k in trained), "trained"
