"""The package's layout: each room imports only what it needs (the core, checkpoints and both command-line tools
run without Lightning), no import cycles, nothing imports the package root, benchmarks do not ship, and
``__version__`` comes from the installed distribution."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import zero_strategy
from zero_strategy.config import ZeroConfig
from zero_strategy.core.stage import ZeroStage

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "zero_strategy"
# Importing any of these raises ImportError in the subprocesses below, as if Lightning were not installed.
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")
BLOCKER = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in LIGHTNING_PACKAGES)

WITHOUT_LIGHTNING = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import torch
    from torch import nn

    try:
        import lightning
    except ImportError:
        pass
    else:
        raise AssertionError("the blocker did not work")

    import zero_strategy
    assert not hasattr(zero_strategy, "ZeroStrategy")  # the adapters are skipped, the rest is there
    rooms = ["zero_strategy.core", "zero_strategy.checkpoint", "zero_strategy.estimate",
             "zero_strategy.deepspeed_import"]
    for room in rooms:
        package = importlib.import_module(room)
        for info in pkgutil.walk_packages(package.__path__, room + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    for module in ("zero_strategy.deepspeed_config", "zero_strategy.names", "zero_strategy.config",
                   "zero_strategy.initial_values"):
        importlib.import_module(module)

    # zero-to-fp32 on a real one-rank stage-3 checkpoint
    from zero_strategy import ZeroConfig, ZeroEngine
    from zero_strategy.checkpoint.export.cli import main as zero_to_fp32
    from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3))
    model(torch.randn(4, 5)).square().mean().backward()
    engine.optimizer_step(optimizer)
    out_dir = sys.argv[1]
    save_sharded(engine, f"{out_dir}/ck", {"global_step": 1}, SaveInfo("32-true", {}, {"torch": torch.__version__}))
    with engine.gathered_parameters():
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert zero_to_fp32([f"{out_dir}/ck", f"{out_dir}/model.pt", "--no-progress"]) == 0
    got = torch.load(f"{out_dir}/model.pt", weights_only=True)
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in got), "consolidated"

    # zero-estimate's table
    from zero_strategy.estimate.cli import main as zero_estimate
    assert zero_estimate(["--params", "7e9", "--world-size", "8", "--device-memory", "80GB"]) == 0
    assert not any(name.split(".")[0] in {blocked} for name, m in sys.modules.items() if m is not None)
    print("ok")
    """
)


def _without_lightning(command: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with Lightning unimportable (a ``sitecustomize`` on PYTHONPATH blocks it at start-up)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run(command, capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)


def _console_script(name: str, module: str) -> list[str]:
    """The installed console script (what users type), else the same entry point through ``python -m``."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


@pytest.mark.timeout(120)
def test_core_checkpoint_and_both_commands_work_without_lightning(tmp_path):
    script = WITHOUT_LIGHTNING.replace("{blocked}", repr(set(LIGHTNING_PACKAGES)))
    done = _without_lightning([sys.executable, "-c", script, str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Smallest that fits" in done.stdout and done.stdout.rstrip().endswith("ok")
    for name, module, usage in (
        ("zero-estimate", "zero_strategy.estimate", "--world-size"),
        ("zero-to-fp32", "zero_strategy.checkpoint", "checkpoint [output]"),
    ):
        helped = _without_lightning([*_console_script(name, module), "--help"], tmp_path)
        assert helped.returncode == 0, helped.stderr[-3000:]
        assert usage in helped.stdout, helped.stdout


# ---------------------------------------------------------------------------------------------- import graph
def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Package modules ``path`` imports explicitly, at any depth (function-level imports too)."""
    name = _module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"{name}: the package uses absolute imports only"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {module for module in found if module in modules and module != name}


def _import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


@pytest.mark.timeout(30)
def test_no_import_cycles_and_no_arrow_pointing_up():
    graph = _import_graph()
    assert _cycles(graph) == []
    importers_of_root = sorted(module for module, targets in graph.items() if "zero_strategy" in targets)
    assert importers_of_root == [], "the package root imports the rooms, never the other way round"
    # the core is pure torch plus its config; the user-facing tools do not reach into the Lightning adapter
    for module, targets in graph.items():
        if module.startswith("zero_strategy.core"):
            outside = {t for t in targets if not t.startswith("zero_strategy.core")} - {"zero_strategy.config"}
            assert outside == set(), f"{module} imports {outside}"
        if not module.startswith("zero_strategy.lightning") and module != "zero_strategy":
            assert not {t for t in targets if t.startswith("zero_strategy.lightning")}, module
        # nothing below the adapters reaches up into them or their plumbing
        adapters = ("zero_strategy.lightning", "zero_strategy.fabric", "zero_strategy.adapter_plumbing")
        if not module.startswith(adapters) and module != "zero_strategy":
            assert not {t for t in targets if t.startswith(adapters)}, module


CORE_ROOMS = ["plan", "comm", "flat", "init", "runtime", "engine"]  # each imports only the rooms before it
CORE_OLD_PATHS = {"step": "engine"}  # an old room name kept for the import paths users hold -> the room it re-exports


@pytest.mark.timeout(30)
def test_core_rooms_import_downwards_only():
    """The README's layout: plan ← comm ← flat ← init ← runtime ← engine (and stage.py and once.py, leaves any room
    may read)."""
    upward = []
    for module, targets in _import_graph().items():
        parts = module.split(".")
        if parts[:2] != ["zero_strategy", "core"] or len(parts) < 4:
            continue
        room = CORE_ROOMS.index(CORE_OLD_PATHS.get(parts[2], parts[2]))
        for target in targets:
            tparts = target.split(".")
            if tparts[:2] == ["zero_strategy", "core"] and len(tparts) >= 4 and CORE_ROOMS.index(tparts[2]) > room:
                upward.append(f"{module} -> {target}")
    assert sorted(set(CORE_ROOMS) | set(CORE_OLD_PATHS) | {"stage.py", "once.py", "__init__.py"}) == sorted(
        p.name for p in (PACKAGE / "core").iterdir() if p.name != "__pycache__"), "a new room belongs in CORE_ROOMS"
    assert not upward, upward


# Each checkpoint room and the rooms it may import (the order of the package docstring of zero_strategy.checkpoint):
# base <- sharded <- deepspeed <- {dcp, export}; dcp <- pretrained; everything <- strategy_io.
CHECKPOINT_ROOMS = {
    "base": set(),
    "sharded": {"base"},
    "dcp": {"base", "sharded", "deepspeed"},
    "deepspeed": {"base", "sharded"},
    "export": {"base", "sharded", "deepspeed"},
    "pretrained": {"base", "sharded", "dcp", "deepspeed"},
    "strategy_io": {"base", "sharded", "dcp", "deepspeed", "export", "pretrained"},
}
# The modules directly in checkpoint/: old import paths kept as aliases of their new homes, and ``python -m``.
CHECKPOINT_ALIASES = {"consolidate", "hf_export", "save", "dcp_load", "dcp_cli", "__main__"}


def _checkpoint_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["zero_strategy", "checkpoint"] and len(parts) >= 4 else None


@pytest.mark.timeout(30)
def test_checkpoint_rooms_import_one_way():
    """checkpoint/'s rooms import only the rooms before them, never an old-path alias, an adapter or the engine: they
    read a sharded model through the protocols of checkpoint/base/writable.py and loadable.py."""
    checkpoint = PACKAGE / "checkpoint"
    rooms = sorted(p.name for p in checkpoint.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted(CHECKPOINT_ROOMS), "a new checkpoint room belongs in CHECKPOINT_ROOMS"
    loose = sorted(p.stem for p in checkpoint.glob("*.py") if p.stem != "__init__")
    assert loose == sorted(CHECKPOINT_ALIASES), "new checkpoint code belongs in a room; the top level holds aliases"
    graph = _import_graph()
    forbidden = []
    for module, targets in graph.items():
        room = _checkpoint_room(module)
        if room is None:
            continue
        for target in targets:
            target_room = _checkpoint_room(target)
            if target.startswith("zero_strategy.checkpoint.") and target_room is None:
                forbidden.append(f"{module} -> {target} (an alias or the package root)")
            elif target_room is not None and target_room != room and target_room not in CHECKPOINT_ROOMS[room]:
                forbidden.append(f"{module} -> {target}")
            elif target.startswith(("zero_strategy.core.engine.engine", "zero_strategy.fabric")):
                forbidden.append(f"{module} -> {target}")
    assert forbidden == []


@pytest.mark.timeout(30)
def test_checkpoint_aliases_re_export_their_new_homes():
    """The old import paths a user may hold (the README names some) still give the same objects."""
    import importlib

    from zero_strategy.checkpoint.dcp.load import load_dcp
    from zero_strategy.checkpoint.export.consolidate import consolidate
    from zero_strategy.checkpoint.export.hf_export import HfExportError, KeyMap, consolidate_hf
    from zero_strategy.checkpoint.pretrained.open import open_pretrained
    from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded

    old = {
        "zero_strategy.checkpoint.consolidate": {"consolidate": consolidate},
        "zero_strategy.checkpoint.hf_export": {"consolidate_hf": consolidate_hf, "KeyMap": KeyMap,
                                               "HfExportError": HfExportError},
        "zero_strategy.checkpoint.dcp_load": {"load_dcp": load_dcp},
        "zero_strategy.checkpoint.save": {"SaveInfo": SaveInfo, "save_sharded": save_sharded},
        "zero_strategy.checkpoint.pretrained": {"open_pretrained": open_pretrained},
    }
    for path, names in old.items():
        module = importlib.import_module(path)
        assert {name: getattr(module, name) for name in names} == names, path
        assert all(name in module.__all__ for name in names), path
    assert zero_strategy.consolidate is consolidate
    pretrained = importlib.import_module("zero_strategy.checkpoint.pretrained")
    assert zero_strategy.load_pretrained is pretrained.load_pretrained
    for alias in CHECKPOINT_ALIASES - {"__main__"}:
        assert "Old import path" in (importlib.import_module(f"zero_strategy.checkpoint.{alias}").__doc__ or ""), alias
    scripts = (REPO / "pyproject.toml").read_text()
    for entry in re.findall(r'"(zero_strategy\.checkpoint[\w.]*):(\w+)"', scripts):
        assert callable(getattr(importlib.import_module(entry[0]), entry[1])), entry


@pytest.mark.timeout(30)
def test_a_whole_flat_param_is_gathered_in_one_place():
    """Outside the comm room (which implements it) only core/flat calls ``all_gather``: the FlatParam's own
    lifecycle, its secondary copy, and core/flat/whole.py, the one gather of a whole FlatParam that releasing the
    engine and the consolidated Fabric file use."""
    callers = sorted(
        _module_name(path) for path in PACKAGE.rglob("*.py")
        if re.search(r"\ball_gather(_into_tensor)?\(", path.read_text())
        and not _module_name(path).startswith(("zero_strategy.core.comm", "zero_strategy.core.flat"))
    )
    assert callers == [], callers


TRANSPORTS = {
    f"zero_strategy.core.comm.{name}"
    for name in ("native", "point_to_point", "shared_memory", "shm_exchange", "host_segments", "watch", "watched",
                 "in_process", "solo", "streams")
}


@pytest.mark.timeout(30)
def test_only_the_comm_room_names_a_transport_or_reads_the_collectives_option():
    """Everything outside core/comm calls the Comm it was handed: no module imports a transport (the simulated
    one is the public test harness's, zero_strategy.testing), and only EngineComms (core/comm/engine_comms.py)
    reads ``collectives``."""
    graph = _import_graph()
    outside = {module: targets & TRANSPORTS for module, targets in graph.items()
               if not module.startswith("zero_strategy.core.comm") and module != "zero_strategy.testing"}
    # the CUDA copy helpers of offload live beside the streams; they move bytes to and from the host, not between ranks
    allowed_streams = {"zero_strategy.core.flat.storage", "zero_strategy.core.flat.grads",
                       "zero_strategy.core.engine.unused", "zero_strategy.core.flat.flat_param"}
    named = {module: targets - ({"zero_strategy.core.comm.streams"} if module in allowed_streams else set())
             for module, targets in outside.items()}
    assert {module: targets for module, targets in named.items() if targets} == {}
    # the estimator predicts both outcomes of the option (its own --collectives), it moves no bytes
    predicts = {"zero_strategy.config", "zero_strategy.estimate.cli", "zero_strategy.estimate.memory"}
    readers = sorted(
        _module_name(path) for path in PACKAGE.rglob("*.py")
        if re.search(r"\.collectives\b", path.read_text()) and _module_name(path) not in predicts
    )
    assert readers == ["zero_strategy.core.comm.engine_comms"], readers


@pytest.mark.timeout(30)
def test_core_files_and_classes_stay_small():
    """No file in core/ over 350 lines and no class over 300 (a file or class past that holds two
    responsibilities: split it by responsibility)."""
    too_long = {}
    for path in (PACKAGE / "core").rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 350:
            too_long[str(path.relative_to(REPO))] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_long[f"{path.relative_to(REPO)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert too_long == {}


@pytest.mark.timeout(30)
def test_no_package_file_over_350_lines():
    """Every package file, not only the core's, stays within 350 lines (split by responsibility, never squeeze)."""
    too_long = {
        str(path.relative_to(REPO)): lines for path in PACKAGE.rglob("*.py")
        if (lines := path.read_text().count("\n")) > 350
    }
    assert too_long == {}


@pytest.mark.timeout(30)
def test_benchmarks_do_not_ship_with_the_package():
    from setuptools import find_packages

    pyproject = (REPO / "pyproject.toml").read_text()
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*(\[[^\]]*\])", pyproject)
    assert include is not None
    shipped = find_packages(str(REPO), include=ast.literal_eval(include.group(1)))
    assert "zero_strategy" in shipped and "zero_strategy.estimate" in shipped
    assert not [p for p in shipped if not p.startswith("zero_strategy")], shipped
    shipped_files = [p for package in shipped for p in (REPO / package.replace(".", "/")).glob("*.py")]
    assert not [p.name for p in shipped_files if "bench" in p.name], "benchmark modules live in benchmarks/"
    assert (REPO / "benchmarks" / "benchmark.py").exists()


# ------------------------------------------------------------------------------------------- small contracts
@pytest.mark.timeout(30)
def test_version_comes_from_the_distribution(monkeypatch):
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from zero_strategy import version

    assert zero_strategy.__version__ == installed("zero_strategy")

    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(version, "version", not_installed)
    assert version.library_version() == version.UNKNOWN == "0+unknown"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_config_reads_the_stage_as_zero_stage(stage):
    zero_stage = ZeroConfig(stage=stage).zero_stage
    assert zero_stage is ZeroStage(stage)
    assert (zero_stage.reduces_every_microstep, zero_stage.reshards_parameters) == (stage >= 2, stage == 3)


@pytest.mark.timeout(30)
def test_the_old_step_room_path_re_exports_the_loss_scaler():
    """core/step/ was renamed core/engine/ (it holds the engine); the one module the README pointed users at under
    the old name still gives the same classes."""
    from zero_strategy.core.engine import loss_scaler as new
    from zero_strategy.core.step import loss_scaler as old

    assert (old.LossScalerConfig, old.DynamicLossScaler) == (new.LossScalerConfig, new.DynamicLossScaler)
