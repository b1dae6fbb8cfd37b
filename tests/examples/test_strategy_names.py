"""The strategy names are listed once (``zero_strategy.names``): the example's schema takes its enum from that list,
and ``conf/strategy`` holds one config per name that composes to the same stage, launcher and options."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from examples.schema import DEEPSPEED_NAMES, StrategyName, register_schemas
from examples.train import check_strategy
from zero_strategy.config import OffloadDevice
from zero_strategy.names import STRATEGY_NAMES

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_schema_and_conf_cover_exactly_the_registered_names() -> None:
    registered = {entry.name for entry in STRATEGY_NAMES}
    assert {member.value for member in StrategyName} == registered | set(DEEPSPEED_NAMES)
    files = {path.stem for path in (CONF / "strategy").glob("*.yaml")}
    assert files - set(DEEPSPEED_NAMES) == registered, "add or remove conf/strategy/<name>.yaml"


@pytest.mark.timeout(60)
def test_each_conf_file_composes_to_its_registered_meaning() -> None:
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for entry in STRATEGY_NAMES:
            cfg = compose(config_name="config", overrides=[f"strategy={entry.name}"])
            name, zero_config = check_strategy(cfg.strategy)
            assert (name.value, name.stage, name.start_method) == (entry.name, entry.stage, entry.start_method)
            assert zero_config.zero_stage is entry.stage
            for key in ("offload_optimizer", "offload_param"):
                expected = OffloadDevice(entry.options.get(key, "none"))
                assert getattr(zero_config, key) is expected, (entry.name, key)
            assert (zero_config.nvme_path is not None) == ("nvme_path" in entry.options), entry.name
