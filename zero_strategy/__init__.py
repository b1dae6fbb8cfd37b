"""ZeRO sharded data parallelism for PyTorch Lightning.

``import zero_strategy`` registers the strategy names ``zero1``, ``zero2``, ``zero3`` (subprocess launcher, like
``ddp``) and ``zero1_spawn``, ``zero2_spawn``, ``zero3_spawn`` (spawn launcher, for notebooks and tests).
"""

from lightning.pytorch.strategies import StrategyRegistry

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.engine import ZeroEngine
from zero_strategy.core.memory import MemoryReport
from zero_strategy.core.stage import ZeroStage
from zero_strategy.plugins.precision import ZeroPrecision
from zero_strategy.plugins.strategy import ZeroStrategy, install_precision_selection

__version__ = "0.1.0"

ZeroStrategy.register_strategies(StrategyRegistry)
install_precision_selection()

__all__ = [
    "MemoryReport",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "ZeroPrecision",
    "ZeroStage",
    "ZeroStrategy",
    "__version__",
]
