"""A model built in ``configure_model`` (sharded) at stage 3 stays sharded after ``fit``: its parameters are on the
meta device, never gathered whole on a rank. ``trainer.save_checkpoint`` still writes the trained weights, and
``validate`` and a further ``fit`` on the same Trainer continue from them — each compared with DDP doing the same
(popen launcher: every rank runs the whole script). See [Note: releasing a model built sharded] in core/release.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.models import assert_state_close

from zero_strategy.checkpoint.consolidate import consolidate

TESTS_DIR = Path(__file__).resolve().parents[1]
CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}

SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
import lightning.pytorch as pl
import torch
import zero_strategy
from helpers.lit import state_of, train_loader, trainer_kwargs, val_loader
from helpers.models import TiedLM, lm_loss


class BuiltInConfigureModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:  # runs again on every later validate/fit
            self.net = TiedLM(n_blocks=3)

    def training_step(self, batch, batch_idx):
        return lm_loss(self.net, batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.net, batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def meta(model):
    return all(p.is_meta for p in model.parameters())


if __name__ == "__main__":
    out = sys.argv[1]
    for name in ("ddp", "zero3"):
        pl.seed_everything(0, verbose=False)
        model = BuiltInConfigureModel()
        trainer = pl.Trainer(strategy=name, **trainer_kwargs(max_epochs=-1, max_steps=3))
        trainer.fit(model, train_loader())
        result = {{"meta_after_fit": meta(model)}}
        if name == "ddp":
            result["after_fit"] = state_of(model)
        trainer.save_checkpoint(f"{{out}}/{{name}}_fit.ckpt")
        result["val"] = trainer.validate(model, val_loader(), verbose=False)[0]["val_loss"]
        result["meta_after_validate"] = meta(model)
        trainer.fit_loop.epoch_loop.max_steps = 6  # the same Trainer fits on from the weights it holds
        trainer.fit(model, train_loader())
        trainer.save_checkpoint(f"{{out}}/{{name}}_refit.ckpt")
        if name == "ddp":
            result["after_refit"] = state_of(model)
        torch.save(result, f"{{out}}/{{name}}_rank{{trainer.global_rank}}.pt")
"""


@pytest.mark.timeout(240)
def test_a_model_built_sharded_stays_sharded_and_trains_on_like_ddp(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests_dir=str(TESTS_DIR))))
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=220)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "parameters stay sharded" in proc.stderr  # the warning says where the weights are
    ddp = torch.load(tmp_path / "ddp_rank0.pt", weights_only=False)
    assert not ddp["meta_after_fit"]
    for rank in range(2):
        zero = torch.load(tmp_path / f"zero3_rank{rank}.pt", weights_only=False)
        assert zero["meta_after_fit"] and zero["meta_after_validate"], f"rank {rank}: gathered after all"
        assert zero["val"] == pytest.approx(ddp["val"], rel=1e-5), f"rank {rank}: validate after fit"
    fitted = torch.load(consolidate(tmp_path / "zero3_fit.ckpt", tmp_path / "fit.pt"), weights_only=True)
    assert_state_close(fitted, ddp["after_fit"], what="zero3 saved after fit vs ddp after fit")
    refitted = torch.load(consolidate(tmp_path / "zero3_refit.ckpt", tmp_path / "refit.pt"), weights_only=True)
    assert_state_close(refitted, ddp["after_refit"], what="zero3 second fit vs ddp second fit")
    assert not torch.allclose(ddp["after_refit"]["net.head.weight"], ddp["after_fit"]["net.head.weight"])
