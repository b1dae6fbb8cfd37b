"""Hydra schemas of the example's config groups (``conf/``), registered in Hydra's ConfigStore.

Every group is typed by a dataclass, so a misspelt key (``trainer.foo=1``) or a wrong type
(``trainer.devices=two``) fails while Hydra composes the config, naming the key, before any process starts.
Values that need more than a type check (``strategy.stage=7``) are validated by the library's own dataclasses
in ``train.py``, still before the Trainer exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from examples.gpt import GPTConfig
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.loss_scaler import LossScalerConfig
from zero_strategy.core.stage import ZeroStage
from zero_strategy.names import BY_NAME

DEEPSPEED_NAMES = ("deepspeed", "deepspeed_spawn")
"""The example's own names (not registered with Lightning): import a DeepSpeed JSON config."""


class _StrategyNames(Enum):
    """What a strategy name stands for, read from the library's single list (``zero_strategy.names``)."""

    @property
    def stage(self) -> ZeroStage | None:
        """The ZeRO stage the name stands for (None for ``deepspeed``: the DeepSpeed config says)."""
        return None if self.is_deepspeed else BY_NAME[self.value].stage

    @property
    def is_deepspeed(self) -> bool:
        return self.value in DEEPSPEED_NAMES

    @property
    def start_method(self) -> str:
        """How ranks are started: ``"spawn"`` (multiprocessing) or ``"popen"`` (re-run the script)."""
        return "spawn" if self.value.endswith("_spawn") else "popen"


# The enum OmegaConf validates ``strategy.name`` against: every name the library registers, plus the example's
# DeepSpeed import, so a new library name is accepted here without an edit. (mypy cannot follow a functional enum
# of a subclass, so it sees the base class with the properties.)
if TYPE_CHECKING:
    StrategyName = _StrategyNames
else:
    StrategyName = _StrategyNames(
        "StrategyName", [(n, n) for n in (*BY_NAME, *DEEPSPEED_NAMES)], module=__name__, qualname="StrategyName"
    )


@dataclass(kw_only=True, slots=True)
class StrategySchema(ZeroConfig):
    """The ``strategy`` group: a registered name plus every :class:`~zero_strategy.config.ZeroConfig` option.

    Inherits the options rather than restating them, so a new library option is settable from the shell at once.
    """

    name: StrategyName = MISSING
    """Registered strategy name; its ``_spawn`` suffix picks the start method and its digit must equal ``stage``."""

    config: str | None = None
    """``strategy=deepspeed`` only: path of a DeepSpeed JSON config, imported with
    ``ZeroStrategy.from_deepspeed_config`` (its ZeRO, precision, clipping and batch keys decide the run)."""


@dataclass(kw_only=True)
class PrecisionSchema(LossScalerConfig):
    """The ``precision`` group: :class:`zero_strategy.ZeroPrecision`; the loss-scale knobs (DeepSpeed's names and
    defaults) are inherited from the library's :class:`~zero_strategy.core.engine.loss_scaler.LossScalerConfig`."""

    precision: str = "32-true"
    """"32-true", "bf16-mixed" or "16-mixed"."""
    reduce_dtype: str | None = None
    """Dtype gradients are reduced in: "fp32" (default), "bf16" or "fp16"."""


@dataclass(kw_only=True)
class TrainerSchema:
    """The ``trainer`` group: the ``lightning.pytorch.Trainer`` arguments this example lets you set."""

    accelerator: str = "cpu"
    devices: int = 2
    num_nodes: int = 1
    max_steps: int = -1
    max_epochs: int | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    log_every_n_steps: int = 50
    val_check_interval: int | float = 1.0
    """An int counts training batches; a float is a fraction of an epoch."""
    check_val_every_n_epoch: int | None = 1
    """``None`` lets an int ``val_check_interval`` run across epoch boundaries."""
    limit_val_batches: int | float = 1.0
    num_sanity_val_steps: int = 2
    enable_checkpointing: bool = False
    enable_progress_bar: bool = True
    enable_model_summary: bool = True


@dataclass(kw_only=True)
class DataSchema:
    """The ``data`` group: arguments of :class:`examples.data.CharDataModule`."""

    path: str | None = None
    """Text file to train on; ``None`` is the bundled ``examples/data/corpus.txt``. Relative paths are taken
    from the directory the command was started in."""
    block_size: int = II("model.block_size")
    """Window length; follows the model's context length unless set."""
    batch_size: int = 32
    """Windows per micro-batch on each rank."""
    val_fraction: float = 0.1
    """Tail of the corpus held out for validation."""
    num_workers: int = 0


@dataclass(kw_only=True)
class TrainConfig:
    """The whole config of ``examples/train.py``: one typed node per group."""

    seed: int = 1337
    strategy: StrategySchema = MISSING
    # A default instance, not MISSING: OmegaConf 2.3 fails (bare AssertionError) expanding a MISSING node whose
    # schema has Union fields under Hydra's merge flags.
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    precision: PrecisionSchema = field(default_factory=PrecisionSchema)
    model: GPTConfig = MISSING
    data: DataSchema = MISSING


def register_schemas() -> None:
    """Register :class:`TrainConfig` as ``train_schema`` (named first in ``conf/config.yaml``'s defaults)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
