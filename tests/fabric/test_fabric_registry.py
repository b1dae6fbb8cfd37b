"""``import zero_strategy`` registers the ZeRO names with Fabric too, and the one Fabric that selects one runs
ZeroFabricPrecision built from its own precision flag (fp16 on a CPU stays fp16); every other Fabric chooses as
Lightning does. ``zero-fabric run`` (Lightning's ``fabric run`` with the names registered) launches a script under
``--strategy zero3``. Only the last test starts processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY

from zero_strategy import ZeroFabricPrecision, ZeroFabricStrategy, ZeroPrecision
from zero_strategy.names import STRATEGY_NAMES

CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}


@pytest.mark.timeout(30)
def test_every_name_is_registered_with_fabric() -> None:
    ours = {name for name in STRATEGY_REGISTRY.available_strategies()
            if STRATEGY_REGISTRY[name]["strategy"] is ZeroFabricStrategy}
    assert ours == {entry.name for entry in STRATEGY_NAMES}
    for entry in STRATEGY_NAMES:
        strategy = STRATEGY_REGISTRY.get(entry.name)
        assert (strategy.config.zero_stage, strategy._start_method) == (entry.stage, entry.start_method)
        assert {key: getattr(strategy.config, key) for key in entry.options} == dict(entry.options)
    ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # a second registration must not raise


@pytest.mark.timeout(30)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_the_fabric_flag_becomes_zero_precision_as_written(precision: str) -> None:
    for strategy in ("zero3", ZeroFabricStrategy(stage=2)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "fp16 is not supported on CPU, using bf16" rewrite
            fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2, precision=precision)
        plugin = fabric.strategy.precision
        assert isinstance(plugin, ZeroFabricPrecision) and plugin.precision == precision
        assert fabric._precision is plugin
        assert "_check_and_init_precision" not in vars(fabric._connector)  # taken over for one call only


@pytest.mark.timeout(30)
def test_precision_conflicts_and_unsupported_ones_fail_clearly() -> None:
    with pytest.raises(ValueError, match="requested twice"):
        Fabric(strategy=ZeroFabricStrategy(stage=3, precision=ZeroFabricPrecision("bf16-mixed")), accelerator="cpu",
               devices=2, precision="16-mixed")
    with pytest.raises(ValueError, match="keeps fp32 master weights"):
        Fabric(strategy="zero3", accelerator="cpu", devices=2, precision="bf16-true")
    plugin = Fabric(strategy="zero1", accelerator="cpu", devices=2, plugins=[MixedPrecision("bf16-mixed", "cpu")])
    assert isinstance(plugin.strategy.precision, ZeroFabricPrecision)  # a Fabric plugin is translated
    assert not isinstance(ZeroPrecision(), ZeroFabricPrecision)  # the Trainer's plugin is a class of its own


@pytest.mark.timeout(30)
def test_other_fabrics_choose_precision_as_lightning_does() -> None:
    ZeroFabricStrategy(stage=3)  # built outside a Fabric: nothing taken over
    with pytest.warns(UserWarning, match="not supported on CPU"):
        fabric = Fabric(strategy="ddp", accelerator="cpu", devices=2, precision="16-mixed")
    assert isinstance(fabric.strategy.precision, MixedPrecision) and fabric.strategy.precision.precision == "bf16-mixed"


@pytest.mark.timeout(30)
def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="state_dict_type"):
        ZeroFabricStrategy(stage=3, state_dict_type="dcp")
    with pytest.raises(ValueError, match="not available under Fabric"):
        ZeroFabricStrategy(stage=3, checkpoint_format="dcp")
    with pytest.raises(ValueError, match="meta_init"):
        ZeroFabricStrategy(stage=3, meta_init="random")
    with pytest.raises(ValueError, match=r"profile=True .* strategy.engine\(model\).comm_log"):
        ZeroFabricStrategy(stage=3, profile=True)
    with pytest.raises(ValueError, match="start_method='thread'"):
        ZeroFabricStrategy(stage=3, start_method="thread")
    assert ZeroFabricStrategy(stage=1, prefetch=False).config.prefetch is False


SCRIPT = """
import torch
import zero_strategy
from lightning.fabric import Fabric

fabric = Fabric()  # strategy, accelerator and devices come from the command line
model = torch.nn.Linear(4, 2)
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
fabric.backward(model(torch.ones(2, 4)).sum())
optimizer.step()
print(f"rank {fabric.global_rank}/{fabric.world_size}: {type(fabric.strategy).__name__} "
      f"stage {fabric.strategy.config.stage}", flush=True)
"""


@pytest.mark.timeout(120)
def test_the_fabric_command_line_runs_a_script_under_zero3(tmp_path: Path) -> None:
    from zero_strategy.testing import free_port

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "zero_strategy.fabric", "run", "--strategy", "zero3", "--accelerator", "cpu",
         "--devices", "2", "--main-port", str(free_port()), str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Lightning's own command cannot see the names: it builds its choices before anything imports zero_strategy
    lightning_cli = subprocess.run([sys.executable, "-m", "lightning.fabric.cli", "run", "--strategy", "zero3",
                                    str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert lightning_cli.returncode != 0 and "zero3" in lightning_cli.stderr, lightning_cli.stderr[-2000:]
    reports = sorted(re.findall(r"rank \d/\d: \w+ stage \d", done.stdout))  # the ranks share one stdout
    assert reports == ["rank 0/2: ZeroFabricStrategy stage 3", "rank 1/2: ZeroFabricStrategy stage 3"], done.stdout
