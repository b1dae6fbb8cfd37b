"""``trainer.save_checkpoint`` for every launcher × construction × call site (see [Note: saving after fit] in
zero_strategy/lightning/sharded_model.py): it writes the trained weights — checked by consolidating it and
comparing with the state_dict the ranks gathered at the end of training — or, where this process never held them
(a model built in configure_model, fitted by a spawn launcher's workers), it raises naming the saves that work. It
never writes an empty checkpoint. ``Trainer.init_module(empty_init=True)`` under a spawn launcher is refused at once:
the workers could not replay a construction recorded in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.save_matrix import CALL_SITES, CONSTRUCTIONS, run

from zero_strategy.checkpoint.export.consolidate import consolidate

TESTS_DIR = Path(__file__).resolve().parents[1]
CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}

POPEN_SCRIPT = """
import json, sys
sys.path.insert(0, {tests_dir!r})
from pathlib import Path
import zero_strategy
from helpers.save_matrix import CONSTRUCTIONS, run

if __name__ == "__main__":
    out = Path(sys.argv[1])
    outcomes = {{c: run("zero3", c, out / c) for c in CONSTRUCTIONS}}
    import torch.distributed as dist
    if dist.get_rank() == 0:
        (out / "outcomes.json").write_text(json.dumps(outcomes))
"""


@pytest.fixture(scope="module")
def popen_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The plain launcher (every rank runs the script): the three constructions in one launch."""
    out = tmp_path_factory.mktemp("popen_saves")
    script = out / "script.py"
    script.write_text(textwrap.dedent(POPEN_SCRIPT.format(tests_dir=str(TESTS_DIR))))
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, cwd=out, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, json.loads((out / "outcomes.json").read_text())


@pytest.fixture(scope="module")
def spawn_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The spawn launcher: fit, validate and test run in worker processes; the saves after them in this one."""
    out = tmp_path_factory.mktemp("spawn_saves")
    return out, {c: run("zero3_spawn", c, out / c) for c in CONSTRUCTIONS}


def _consolidated_equals_trained(run_dir: Path, site: str) -> None:
    trained = torch.load(run_dir / "trained.pt", weights_only=True)
    got = torch.load(consolidate(run_dir / f"{site}.ckpt", run_dir / f"{site}.pt", progress=False), weights_only=True)
    assert list(got) == list(trained), f"{site}: keys {list(got)} vs {list(trained)}"
    for key, value in trained.items():
        assert torch.equal(got[key], value), f"{site}: {key} is not the trained value"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("site", CALL_SITES)
@pytest.mark.parametrize("construction", CONSTRUCTIONS)
def test_plain_launcher_saves_the_trained_weights(popen_runs, construction: str, site: str) -> None:
    out, outcomes = popen_runs
    assert outcomes[construction][site] == "ok", outcomes[construction][site]
    _consolidated_equals_trained(out / construction, site)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("site", CALL_SITES)
@pytest.mark.parametrize("construction", CONSTRUCTIONS)
def test_spawn_launcher_saves_the_weights_or_says_why_not(spawn_runs, construction: str, site: str) -> None:
    out, outcomes = spawn_runs
    result = outcomes[construction][site]
    if construction == "init_module":  # refused at init_module: the workers could not replay this construction
        assert result.startswith("RuntimeError: Trainer.init_module(empty_init=True) with start_method='spawn'"), result
        assert "configure_model" in result and "zero3" in result, result
        return
    if site == "during_fit" or construction == "eager":
        # in the workers with their engine; or, after fit, the weights Lightning handed back to this process
        assert result == "ok", result
        _consolidated_equals_trained(out / construction, site)
        return
    # this process never held the values (they were built and trained in the exited workers): no empty checkpoint
    assert result.startswith("CheckpointError: cannot save"), result
    assert "ModelCheckpoint" in result and "plain launcher" in result, result
    assert not (out / construction / f"{site}.ckpt").exists()
