"""``trainer.save_checkpoint`` after ``fit`` returned writes the sharded directory a save during fit writes.

Popen launching (the plain names): every rank still has the fit's optimizer state, so the checkpoint resumes with
it; the reference is DDP resuming its own post-fit checkpoint, same seed and data (Lightning itself resumes a
post-fit checkpoint at a shifted data position, see LIGHTNING.md, so the reference is DDP doing the same, not an
uninterrupted run). Spawn launching: the main process has only the weights; the directory holds them and says
that the optimizer state is absent, and a resume from it stops with that reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import lit
from helpers.models import assert_state_close

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, CheckpointError
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint

TESTS_DIR = Path(__file__).resolve().parents[1]
CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}
FIRST_STEPS, RESUMED_STEPS = 3, 6  # 7 micro-batches per rank and epoch, accumulate_grad_batches=3: 3 steps/epoch

SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
import lightning.pytorch as pl
import torch
import zero_strategy
from helpers.lit import LitTiedLM, state_of, test_loader, train_loader, trainer_kwargs
from helpers.models import lm_loss

if __name__ == "__main__":
    out = sys.argv[1]
    for name in ("ddp", "zero3"):
        pl.seed_everything(0, verbose=False)
        model = LitTiedLM()
        trainer = pl.Trainer(strategy=name, **trainer_kwargs(max_epochs=-1, max_steps={first}))
        trainer.fit(model, train_loader())
        result = {{"after_fit": state_of(model)}}
        trainer.save_checkpoint(f"{{out}}/{{name}}.ckpt")
        result["after_save"] = state_of(model)
        if name == "zero3":  # fit, save, then test on the same Trainer
            result["test"] = trainer.test(model, test_loader(), verbose=False)
            with torch.no_grad():
                result["local_test_loss"] = lm_loss(model.net, test_loader().dataset.tokens).item()
        # the same Trainer fits again, resuming from the post-fit checkpoint
        trainer.fit_loop.epoch_loop.max_steps = {resumed}
        trainer.fit(model, train_loader(), ckpt_path=f"{{out}}/{{name}}.ckpt")
        result["resumed"] = state_of(model)
        result["global_step"] = trainer.global_step
        torch.save(result, f"{{out}}/{{name}}_rank{{trainer.global_rank}}.pt")
"""


@pytest.fixture(scope="module")
def popen_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("save_after_fit")
    script = out / "script.py"
    script.write_text(
        textwrap.dedent(SCRIPT.format(tests_dir=str(TESTS_DIR), first=FIRST_STEPS, resumed=RESUMED_STEPS))
    )
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, cwd=out, capture_output=True, text=True, timeout=200
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]
               for name in ("ddp", "zero3")}
    return out, results


@pytest.mark.timeout(240)
def test_popen_save_after_fit_resumes_like_ddp(popen_run):
    out, results = popen_run
    ddp = results["ddp"][0]
    ckpt = out / "zero3.ckpt"
    assert ckpt.is_dir() and (ckpt / MANIFEST_NAME).is_file()
    with ShardedCheckpoint(ckpt) as opened:
        assert opened.manifest.has_optimizer_state and opened.manifest.world_size == 2
        assert opened.state_names(opened.manifest.flat_params[0]) == ["momentum_buffer"]
    for rank, r in enumerate(results["zero3"]):
        assert r["global_step"] == RESUMED_STEPS
        assert_state_close(r["after_fit"], ddp["after_fit"], what=f"rank {rank}: zero3 fit vs ddp fit")
        for key, value in r["after_fit"].items():  # the save left the module's full parameters as they were
            assert torch.equal(r["after_save"][key], value), f"rank {rank}: {key} changed by the save"
        # optimizer state (SGD momentum 0.9) restored: equal to DDP resuming its own post-fit checkpoint
        assert_state_close(r["resumed"], ddp["resumed"], what=f"rank {rank}: zero3 resumed vs ddp resumed")
        assert r["test"][0]["test_loss"] == pytest.approx(r["local_test_loss"], rel=1e-5)
    # the resumed run moved the weights (the parity above is not two copies of the checkpoint's weights)
    assert not torch.allclose(ddp["resumed"]["net.head.weight"], ddp["after_fit"]["net.head.weight"])
    consolidated = torch.load(consolidate(ckpt, out / "model.pt"), weights_only=True)
    assert list(consolidated) == list(ddp["after_fit"])
    for key, value in results["zero3"][0]["after_fit"].items():
        assert torch.equal(consolidated[key], value), f"consolidated {key} is not the module's after fit"


@pytest.mark.timeout(120)
def test_spawn_save_after_fit_writes_weights_and_refuses_resume(tmp_path):
    model, trainer = lit.fit_lm("zero3_spawn", None, max_epochs=1)
    fitted = lit.state_of(model)
    assert trainer.optimizers == []  # the optimizer state stayed in the workers
    with pytest.warns(UserWarning, match="spawn-launched fit"):
        trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert (tmp_path / "run.ckpt" / MANIFEST_NAME).is_file()
    with ShardedCheckpoint(tmp_path / "run.ckpt") as opened:
        assert not opened.manifest.has_optimizer_state
    for key, value in lit.state_of(model).items():
        assert torch.equal(value, fitted[key]), f"{key} changed by the save"
    consolidated = torch.load(consolidate(tmp_path / "run.ckpt", tmp_path / "model.pt"), weights_only=True)
    assert list(consolidated) == list(fitted)
    for key, value in fitted.items():
        assert torch.equal(consolidated[key], value), key
    resumed = pl.Trainer(strategy="zero3_spawn", **lit.trainer_kwargs(max_epochs=2))
    with pytest.raises(Exception, match=r"holds no optimizer state \(saved after a spawn-launched fit") as info:
        resumed.fit(lit.LitTiedLM(), lit.train_loader(), ckpt_path=tmp_path / "run.ckpt")
    assert isinstance(info.value, CheckpointError) or "CheckpointError" in str(info.value)
