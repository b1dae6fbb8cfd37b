"""The popen-launched names ``zero1``/``zero2``/``zero3`` (Lightning re-runs the script for rank 1), as a user's
script runs them: one script, several Trainers one after another, ``ddp`` as the reference.

This is also the only place where Trainer entry points run in the *same processes* one after another (with spawn
launching every entry point starts fresh processes), so it is where ``setup`` must cope with a module and
optimizers that were already used, and where every rank's module can be inspected after ``fit``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import lit
from helpers.models import assert_state_close

TESTS_DIR = Path(__file__).resolve().parents[1]
CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}
BY_VALUE = {"gradient_clip_algorithm": "value", "gradient_clip_val": 0.01}
RUNS = {  # label: (strategy name, Trainer overrides)
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "ddp_by_value": ("ddp", BY_VALUE),
    "zero3_by_value": ("zero3", BY_VALUE),
}

SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
import lightning.pytorch as pl
import torch
import zero_strategy  # registers zero1/zero2/zero3
from helpers.lit import fit_lm, state_of, test_loader, trainer_kwargs, val_loader
from helpers.models import lm_loss

if __name__ == "__main__":
    out_dir = sys.argv[1]
    for label, (name, overrides) in {runs!r}.items():
        model, trainer = fit_lm(name, None, **overrides)
        result = {{
            "strategy": type(trainer.strategy).__name__,
            "stage": getattr(getattr(trainer.strategy, "config", None), "stage", None),
            "world_size": trainer.world_size,
            "fitted": state_of(model),
            "storage_bytes": [p.untyped_storage().nbytes() for p in model.parameters()],
            "tied": model.net.head.weight is model.net.emb.weight,
        }}
        if not overrides:
            try:  # every rank fails the same way if it fails, so the ranks stay in step
                result["test"] = trainer.test(model, test_loader(), verbose=False)
                result["after_test"] = state_of(model)
                with torch.no_grad():
                    result["local_test_loss"] = lm_loss(model.net, test_loader().dataset.tokens).item()
            except Exception as error:
                result["test_error"] = repr(error)
            # a fresh Trainer that only validates: no optimizers at all
            fresh = pl.Trainer(strategy=name, **trainer_kwargs())
            result["validate"] = fresh.validate(model, val_loader(), verbose=False)
            with torch.no_grad():
                result["local_val_loss"] = lm_loss(model.net, val_loader().dataset.tokens).item()
        torch.save(result, f"{{out_dir}}/{{label}}_rank{{trainer.global_rank}}.pt")
"""


@pytest.fixture(scope="module")
def popen_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("popen")
    script = out_dir / "train_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests_dir=str(TESTS_DIR), runs=RUNS)))
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    proc = subprocess.run(
        [sys.executable, str(script), str(out_dir)],
        env=env,
        cwd=out_dir,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {
        label: [torch.load(out_dir / f"{label}_rank{r}.pt", weights_only=False) for r in range(2)] for label in RUNS
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["zero1", "zero2", "zero3"])
def test_popen_name_fit_matches_ddp(popen_results, label):
    """Weights after fit match DDP on *every* rank, each rank's module holds full parameters of its own, and the
    tied weight is still one tensor."""
    ddp = popen_results["ddp"][0]
    assert ddp["world_size"] == 2
    for rank, r in enumerate(popen_results[label]):
        assert (r["strategy"], r["stage"], r["world_size"]) == ("ZeroStrategy", int(label[-1]), 2)
        assert r["tied"]
        assert all(nbytes > 0 for nbytes in r["storage_bytes"]), f"rank {rank}: a parameter has no storage"
        assert_state_close(r["fitted"], ddp["fitted"], rel=1e-5, what=f"{label} (popen) rank {rank} vs ddp")


@pytest.mark.timeout(240)
def test_popen_clip_by_value_matches_ddp(popen_results):
    ref, got = popen_results["ddp_by_value"][0], popen_results["zero3_by_value"][0]
    assert_state_close(got["fitted"], ref["fitted"], rel=1e-5, what="zero3 clip-by-value vs ddp")
    # clipping by value must have mattered: the norm-clipped run ended elsewhere
    key = "net.blocks.0.fc.weight"
    assert not torch.allclose(ref["fitted"][key], popen_results["ddp"][0]["fitted"][key])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["zero1", "zero2", "zero3"])
def test_popen_validate_on_a_fresh_trainer(popen_results, label):
    for rank, r in enumerate(popen_results[label]):
        assert r["validate"][0]["val_loss"] == pytest.approx(r["local_val_loss"], rel=1e-5), rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["zero1", "zero2", "zero3"])
def test_popen_fit_then_test_same_trainer(popen_results, label):
    assert popen_results["ddp"][0].get("test_error") is None  # the reference itself does fit-then-test fine
    for rank, r in enumerate(popen_results[label]):
        assert r.get("test_error") is None, (rank, r.get("test_error"))
        # test() re-shards the same module and leaves it whole and unchanged
        assert_state_close(r["after_test"], r["fitted"], rel=0.0, what=f"{label}: weights changed by test()")
        assert r["test"][0]["test_loss"] == pytest.approx(r["local_test_loss"], rel=1e-5)
        assert r["test"][0]["test_idx_mean"] == pytest.approx((lit.N_TEST - 1) / 2, abs=1e-6)
