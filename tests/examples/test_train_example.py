"""The main job (``examples/train.py``): configs compose and reject bad input early, the GPT and its data behave,
and a tiny 2-process ZeRO run finishes and reports its perplexity."""

import io
import json
import math
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch import nn

from examples.data import CharDataModule
from examples.gpt import GPT, GPTConfig, WarmupCosine
from examples.schema import StrategyName, register_schemas
from examples.train import build_precision, build_strategy, check_strategy

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO_ROOT / "examples" / "train.py"
CORPUS = REPO_ROOT / "examples" / "data" / "corpus.txt"
# Set by Lightning's launcher in a rank's environment; inherited, they would make the script think it is a rank.
LAUNCH_ENV = ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK")
TINY_MODEL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=8"]


def compose_config(overrides: list[str]) -> DictConfig:
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_train(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_train_forked(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python examples/train.py ARGS`` as :func:`run_train` runs it, in a child forked from this process: torch,
    Lightning and Hydra are already imported, so a run that ends during validation takes milliseconds instead of a
    new interpreter's seconds. The child runs the script as ``__main__`` with its own stdout and stderr and ends the
    way the interpreter ends a script: ``SystemExit(None | int)`` is the exit status, any other ``SystemExit``
    prints its value to stderr and exits 1, an uncaught exception prints its traceback and exits 1.
    ``test_a_forked_run_reports_what_a_new_interpreter_reports`` holds the two runners to the same output."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            status = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
                sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
                for key in LAUNCH_ENV:
                    os.environ.pop(key, None)
                os.chdir(cwd)
                sys.argv = [str(TRAIN_SCRIPT), *args]
                try:
                    runpy.run_path(str(TRAIN_SCRIPT), run_name="__main__")
                    status = 0
                except SystemExit as exit_request:
                    if exit_request.code is None or isinstance(exit_request.code, int):
                        status = exit_request.code or 0
                    else:
                        print(exit_request.code, file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        deadline = time.monotonic() + timeout
        while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(TRAIN_SCRIPT.name, timeout)
            time.sleep(0.02)
        returncode = os.waitstatus_to_exitcode(waited[1])
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(
            [str(TRAIN_SCRIPT), *args], returncode, out.read().decode(), err.read().decode()
        )


def tiny_gpt(*, lr_schedule: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32, lr_schedule=lr_schedule))


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.timeout(30)
def test_default_strategy_is_zero3() -> None:
    cfg = compose_config([])
    assert (cfg.strategy.name, cfg.strategy.stage) == (StrategyName.zero3, 3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("suffix", ["", "_spawn"])
def test_every_strategy_choice_composes_and_validates(stage: int, suffix: str) -> None:
    cfg = compose_config([f"strategy=zero{stage}{suffix}", "trainer.devices=4"])
    name, zero_config = check_strategy(cfg.strategy)
    assert name.value == f"zero{stage}{suffix}"
    assert zero_config.stage == stage
    assert name.start_method == ("spawn" if suffix else "popen")
    precision = build_precision(cfg)
    strategy = build_strategy(name, zero_config, cfg, precision)
    assert strategy.config == zero_config  # every option reaches the strategy
    assert strategy.precision_plugin is precision
    assert cfg.trainer.devices == 4
    assert cfg.data.block_size == cfg.model.block_size  # interpolated, so the two cannot drift apart


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategy.stage=7", "strategy.stage"),  # passes the schema (an int), refused by ZeroConfig
        ("strategy.stage=2", "strategy.stage"),  # a real stage, but not the one strategy=zero3 names
        ("trainer.foo=1", "trainer.foo"),  # not a key of the trainer schema
        ("trainer.devices=two", "trainer.devices"),  # wrong type
        ("model.n_head=5", "model.n_head"),  # does not divide n_embd
        ("precision.loss_scale_window=0", "precision.loss_scale_window"),  # refused by ZeroPrecision
        ("precision.precision=64-true", "precision"),  # not a ZeRO precision
        ("strategy.offload_optimizer=tape", "strategy.offload_optimizer"),  # not an OffloadDevice
        ("strategy.keep_window_gradients=maybe", "strategy.keep_window_gradients"),  # not a bool
        ("strategy=deepspeed", "strategy.config"),  # the DeepSpeed entry needs its config file
    ],
)
def test_bad_override_exits_early_naming_the_key(override: str, key: str, tmp_path: Path) -> None:
    result = run_train_forked([override, f"hydra.run.dir={tmp_path}"], cwd=REPO_ROOT, timeout=50)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert key in output
    assert "Traceback" not in output
    assert "Initializing distributed" not in output  # failed before any rank was started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override", ["strategy.stage=7", "trainer.foo=1"])  # refused by us; refused by Hydra
def test_a_forked_run_reports_what_a_new_interpreter_reports(override: str, tmp_path: Path) -> None:
    """The forked runner the bad-override cases use ends as ``python examples/train.py`` does: same exit status,
    same stdout, same stderr."""
    forked = run_train_forked([override, f"hydra.run.dir={tmp_path}"], cwd=REPO_ROOT, timeout=50)
    fresh = run_train([override, f"hydra.run.dir={tmp_path}"], cwd=REPO_ROOT, timeout=50)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode != 0 and fresh.stderr  # a failure that says something, so the comparison means something

@pytest.mark.timeout(30)
def test_hierarchical_params_override_reaches_the_strategy() -> None:
    cfg = compose_config(["strategy=zero3", "strategy.hierarchical_params=node"])
    name, zero_config = check_strategy(cfg.strategy)
    strategy = build_strategy(name, zero_config, cfg, build_precision(cfg))
    assert strategy.config.hierarchical_params == "node"
    with pytest.raises(SystemExit, match="strategy: hierarchical_params needs stage=3"):
        check_strategy(compose_config(["strategy=zero2", "strategy.hierarchical_params=node"]).strategy)


@pytest.mark.timeout(30)
def test_keep_window_gradients_override_reaches_the_strategy() -> None:
    cfg = compose_config(["strategy=zero2", "strategy.keep_window_gradients=true"])
    name, zero_config = check_strategy(cfg.strategy)
    assert build_strategy(name, zero_config, cfg, build_precision(cfg)).config.keep_window_gradients is True
    assert compose_config(["strategy=zero3"]).strategy.keep_window_gradients is None  # auto by default


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["precision=bf16"], ("bf16-mixed", 2**16, "none")),
        (["precision=fp16", "precision.loss_scale_window=50", "precision.initial_scale_power=8"],
         ("16-mixed", 2.0**8, "none")),
        (["strategy=zero3_offload", "precision=fp32"], ("32-true", 1.0, "cpu")),
        (["strategy=zero2", "strategy.offload_optimizer=cpu"], ("32-true", 1.0, "cpu")),
    ],
)
def test_precision_and_offload_overrides_reach_the_plugin(overrides: list[str], expected: tuple) -> None:
    cfg = compose_config(overrides)
    name, zero_config = check_strategy(cfg.strategy)
    strategy = build_strategy(name, zero_config, cfg, build_precision(cfg))
    plugin = strategy.precision_plugin
    assert (plugin.precision, plugin.loss_scale if plugin.scaler else 1.0, strategy.config.offload_optimizer.value) == (
        expected[0], expected[1] if plugin.scaler else 1.0, expected[2]
    )


@pytest.mark.timeout(30)
def test_deepspeed_entry_builds_the_strategy_from_the_json(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 1}, "fp16": {"enabled": true, "hysteresis": 3}}')
    cfg = compose_config(["strategy=deepspeed", f"strategy.config={ds}"])
    name, zero_config = check_strategy(cfg.strategy)
    strategy = build_strategy(name, zero_config, cfg, build_precision(cfg))
    assert strategy.config.stage == 1
    assert strategy.precision_plugin.precision == "16-mixed"
    assert strategy.precision_plugin.scaler.config.hysteresis == 3


# -------------------------------------------------------------------------------------------------- model
@pytest.mark.timeout(30)
def test_gpt_shapes_tied_weight_and_initial_loss() -> None:
    model = tiny_gpt()
    idx = torch.randint(0, 61, (4, 16))
    targets = torch.randint(0, 61, (4, 16))
    logits = model(idx)
    assert logits.shape == (4, 16, 61)
    loss = model.loss(logits, targets)
    # Small random init: close to a uniform guess over the vocabulary.
    assert abs(loss.item() - math.log(61)) < 0.1
    loss.backward()

    tied = [name for name, p in model.named_parameters(remove_duplicate=False) if p is model.tok_emb.weight]
    assert tied == ["tok_emb.weight", "lm_head.weight"]
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.timeout(30)
def test_gpt_is_causal() -> None:
    model = tiny_gpt().eval()
    idx = torch.randint(0, 61, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 61
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.timeout(30)
def test_weight_decay_groups_survive_freed_parameters() -> None:
    model = tiny_gpt(lr_schedule=False)

    def group_ids() -> list[set[int]]:
        optimizer = model.configure_optimizers()
        assert isinstance(optimizer, torch.optim.AdamW)
        return [{id(p) for p in group["params"]} for group in optimizer.param_groups]

    decay, no_decay = group_ids()
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    assert decay == linear_weights - {id(model.tok_emb.weight)}
    assert decay.isdisjoint(no_decay)
    assert decay | no_decay == {id(p) for p in model.parameters()}
    assert id(model.tok_emb.weight) in no_decay

    # ZeRO-3 leaves parameters empty outside forward; the split must not depend on their shapes.
    for param in model.parameters():
        param.data = torch.empty(0)
    assert group_ids() == [decay, no_decay]


@pytest.mark.timeout(30)
def test_warmup_cosine_multiplier() -> None:
    schedule = WarmupCosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1)  # 1/10 of the way up
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)  # cosine starts at its top
    assert schedule(60) == pytest.approx(0.55)  # half way down: the mean of 1 and 0.1
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(1000) == pytest.approx(0.1)  # stays at the floor past the end


# --------------------------------------------------------------------------------------------------- data
@pytest.mark.timeout(30)
def test_char_data_module_vocabulary_and_windows() -> None:
    text = CORPUS.read_text(encoding="utf-8")
    data = CharDataModule(CORPUS, block_size=16, batch_size=4, val_fraction=0.1)
    assert data.chars == sorted(set(text))
    assert data.vocab_size == len(set(text))
    assert data.decode(data.encode(text[:300])) == text[:300]

    data.setup("fit")
    assert data.train_set is not None and data.val_set is not None
    inputs, targets = data.train_set[5]
    assert data.decode(inputs) == text[5:21]
    assert data.decode(targets) == text[6:22]
    n_train = data.train_tokens.numel()
    val_inputs, _ = data.val_set[2]  # validation windows do not overlap
    assert data.decode(val_inputs) == text[n_train + 32 : n_train + 48]
    assert data.decode(data.val_tokens) == text[n_train:]


# ------------------------------------------------------------------------------------------------- main job
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["zero3", "zero1_spawn"])  # the default popen launcher (re-runs the script), spawn
def test_tiny_run_reports_perplexity(strategy: str, tmp_path: Path) -> None:
    """Two ranks started from another directory: a finished fit, a final report, one Hydra run dir for both."""
    args = [
        f"strategy={strategy}",
        *TINY_MODEL,
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "model.warmup_steps=0",
        "strategy.process_group_timeout_s=60",
        "trainer.enable_progress_bar=false",
    ]
    result = run_train(args, cwd=tmp_path, timeout=80)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(r"final val_loss=([\d.]+) val_ppl=([\d.]+)", result.stdout)
    assert match, result.stdout
    val_loss, val_ppl = float(match.group(1)), float(match.group(2))
    vocab_size = len(set(CORPUS.read_text(encoding="utf-8")))
    assert val_ppl < vocab_size  # three steps already beat a uniform guess
    assert val_ppl == pytest.approx(math.exp(val_loss), rel=0.05)

    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1
    logs = {p.name for p in run_dirs[0].iterdir()}
    # With popen, rank 1 re-ran the script into rank 0's run dir (Lightning's Hydra handling).
    assert "train.log" in logs
    assert ("train_ddp_process_1.log" in logs) == (not strategy.endswith("_spawn"))


@pytest.mark.timeout(300)  # two 2-rank runs in one subprocess: 93 s measured in a full-suite run (3x: 280 s)
def test_sweep_writes_a_summary_comparing_the_runs(tmp_path: Path) -> None:
    """``-m strategy=zero1_spawn,zero3_spawn``: both runs finish and one summary.md compares them; zero3 holds
    half the parameter bytes of zero1 per rank (2 ranks), with the same final loss."""
    args = [
        "-m",
        "strategy=zero1_spawn,zero3_spawn",
        *TINY_MODEL,
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "model.warmup_steps=0",
        "trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    result = run_train(args, cwd=tmp_path, timeout=290)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "sweep" / "summary.jsonl").read_text().splitlines()]
    assert [("zero1_spawn" in r["run"], "zero3_spawn" in r["run"]) for r in rows] == [(True, False), (False, True)]
    zero1, zero3 = rows
    assert zero3["parameters"] < 0.6 * zero1["parameters"]
    assert zero3["optimizer_state"] == zero1["optimizer_state"]
    assert zero3["val_loss"] == pytest.approx(zero1["val_loss"], rel=1e-4)
    table = (tmp_path / "sweep" / "summary.md").read_text()
    assert table.count("\n| strategy=") == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "choice",
    [f"strategy={p.stem}" for p in sorted((REPO_ROOT / "conf" / "strategy").glob("*.yaml"))]
    + [f"precision={p.stem}" for p in sorted((REPO_ROOT / "conf" / "precision").glob("*.yaml"))],
)
def test_every_config_in_conf_composes_and_instantiates(choice: str, tmp_path: Path) -> None:
    overrides = [choice]
    if choice.startswith("strategy=deepspeed"):
        overrides.append(f"strategy.config={REPO_ROOT / 'examples' / 'ds_config.json'}")
    cfg = compose_config(overrides)
    name, zero_config = check_strategy(cfg.strategy)
    strategy = build_strategy(name, zero_config, cfg, build_precision(cfg))
    assert strategy.config.stage in (1, 2, 3)
    assert strategy.precision_plugin.precision in ("32-true", "bf16-mixed", "16-mixed")
