"""``import zero_strategy`` patches nothing of Lightning; a ZeroStrategy takes over the precision choice of the one
Trainer that selects it (see [Note: taking over the precision choice of one Trainer] in
zero_strategy/lightning/precision_selection.py). The fits that show fp16 really computing in fp16 on a CPU are in
tests/precision/test_precision_trainer.py; here the Trainers are only constructed (no processes launched)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from zero_strategy import ZeroPrecision, ZeroStrategy

_SNAPSHOT = """
import sys, warnings
import lightning.pytorch, torch.distributed  # what Lightning loads before us

def snapshot():
    # every attribute of every loaded torch/Lightning module, and every attribute of each class defined there
    values, class_dicts = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated torch attributes warn when inspected
        for name, module in list(sys.modules.items()):
            if module is None or name.split(".")[0] not in ("torch", "lightning", "lightning_fabric"):
                continue
            for attr, value in list(vars(module).items()):
                values[(name, attr)] = value
                if isinstance(value, type) and value.__module__ == name:
                    class_dicts[(name, attr)] = dict(vars(value))
    return values, class_dicts

filters = list(warnings.filters)
values, class_dicts = snapshot()
import zero_strategy
values_after, class_dicts_after = snapshot()
changed = [f"{m}.{a}" for (m, a), v in values.items() if (m, a) not in values_after or values_after[m, a] is not v]
for key, members in class_dicts.items():
    after = class_dicts_after.get(key, {})
    changed += [f"{key[0]}.{key[1]}.{k}" for k in set(members) | set(after) if members.get(k) is not after.get(k)]
added_filters = [repr(f) for f in warnings.filters if f not in filters]
print(json.dumps({"changed": changed, "added_filters": added_filters}))
"""


def _run(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", "import json\n" + script], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_import_changes_no_torch_or_lightning_attribute_and_no_warning_filter():
    result = _run(_SNAPSHOT)
    assert result["changed"] == []  # e.g. _AcceleratorConnector._check_and_init_precision stays Lightning's
    assert result["added_filters"] == []


_CHOICES = """
import logging, warnings
import lightning.pytorch as pl
{prelude}
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("lightning.pytorch").addHandler(handler)
out = []
for strategy, precision in [("ddp", "16-mixed"), ("auto", "16-mixed"), ("auto", "bf16-mixed"), ("ddp", "32-true"),
                            ("auto", "64-true"), ("ddp", "bf16-true")]:
    records.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(strategy=strategy, precision=precision, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    plugin = trainer.precision_plugin
    out.append([strategy, precision, type(plugin).__name__, plugin.precision, type(trainer.strategy).__name__,
                sorted(str(w.message) for w in caught), [r for r in records if "Tip" not in r]])
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_other_strategies_choose_precision_and_warn_exactly_as_without_the_import():
    without = _run(_CHOICES.format(prelude=""))
    with_import = _run(_CHOICES.format(prelude="import zero_strategy"))
    assert with_import == without
    # and the comparison has teeth: Lightning alone turns 16-mixed into bf16 AMP on a CPU, with a warning
    ddp_fp16 = without[0]
    assert ddp_fp16[2:4] == ["MixedPrecision", "bf16-mixed"] and any("bf16-mixed" in w for w in ddp_fp16[5])


def _trainer(strategy: object, **kwargs: object) -> pl.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Lightning's "fp16 is not supported on CPU, using bf16" would fail here
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, **kwargs)  # fmt: skip


BY_NAME: Callable[[], object] = lambda: "zero3_spawn"  # noqa: E731
BY_INSTANCE: Callable[[], object] = lambda: ZeroStrategy(stage=3, start_method="spawn")  # noqa: E731
PATHS = pytest.mark.parametrize("make", [BY_NAME, BY_INSTANCE], ids=["by_name", "by_instance"])


@pytest.mark.timeout(60)
@PATHS
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true", None])
def test_the_trainer_flag_becomes_zero_precision_as_written(make, precision):
    trainer = _trainer(make(), **({"precision": precision} if precision is not None else {}))
    plugin = trainer.strategy.precision_plugin
    expected = precision or "32-true"
    assert isinstance(plugin, ZeroPrecision) and plugin.precision == expected
    assert trainer.precision_plugin is plugin
    # the take-over was for that one call: the connector is Lightning's own again, its class untouched
    assert "_check_and_init_precision" not in vars(trainer._accelerator_connector)
    assert _AcceleratorConnector._check_and_init_precision.__module__.startswith("lightning.")


@pytest.mark.timeout(60)
@PATHS
@pytest.mark.parametrize("precision", ["64-true", "16-true", "bf16-true", "transformer-engine"])
def test_a_precision_zero_does_not_run_fails_with_our_message(make, precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}'"):
        _trainer(make(), precision=precision)


@pytest.mark.timeout(60)
def test_precision_given_to_the_strategy_and_to_the_trainer_must_agree():
    own = ZeroPrecision("bf16-mixed")
    with pytest.raises(ValueError, match=r"precision requested twice.*'16-mixed'.*'bf16-mixed'"):
        _trainer(ZeroStrategy(stage=2, start_method="spawn", precision_plugin=own), precision="16-mixed")
    for agreeing in ({"precision": "bf16-mixed"}, {}):  # the same precision, or none given to the Trainer
        trainer = _trainer(ZeroStrategy(stage=2, start_method="spawn", precision_plugin=own), **agreeing)
        assert trainer.strategy.precision_plugin is own


@pytest.mark.timeout(60)
@PATHS
def test_a_precision_plugin_given_to_the_trainer_is_used_or_translated(make):
    given = ZeroPrecision("16-mixed", hysteresis=1)
    assert _trainer(make(), plugins=[given]).strategy.precision_plugin is given
    amp = MixedPrecision("16-mixed", "cpu")
    translated = _trainer(make(), plugins=[amp]).strategy.precision_plugin
    assert isinstance(translated, ZeroPrecision) and translated.precision == "16-mixed"


@pytest.mark.timeout(60)
def test_reading_the_plugin_before_the_trainer_does_not_make_fp32_a_choice():
    strategy = ZeroStrategy(stage=3, start_method="spawn")
    assert strategy.precision_plugin.precision == "32-true"  # read before any Trainer exists
    assert _trainer(strategy, precision="16-mixed").strategy.precision_plugin.precision == "16-mixed"


@pytest.mark.timeout(60)
def test_a_zero_strategy_built_outside_a_trainer_leaves_the_next_ddp_trainer_alone():
    ZeroStrategy(stage=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(strategy="ddp", precision="16-mixed", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.precision_plugin, MixedPrecision) and trainer.precision_plugin.precision == "bf16-mixed"
    assert any("bf16-mixed" in str(w.message) for w in caught)


def test_preemption_installs_nothing_at_import():
    """The SLURM preemption saver is installed per Trainer from the strategy's setup, never at import."""
    script = textwrap.dedent(
        """
        from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
        before = dict(vars(_SignalConnector))
        import zero_strategy
        print(json.dumps({"same": dict(vars(_SignalConnector)) == before}))
        """
    )
    assert _run(script) == {"same": True}
