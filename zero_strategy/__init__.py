"""ZeRO sharded data parallelism for PyTorch Lightning.

``import zero_strategy`` registers the strategy names ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``,
``zero3_offload``, ``zero3_offload_nvme`` (subprocess launcher, like ``ddp``) and each with a ``_spawn`` suffix
(spawn launcher, for notebooks and tests), with the Trainer (``ZeroStrategy``) and with Fabric
(``ZeroFabricStrategy``).
"""

from zero_strategy._requirements import UntestedTorchWarning, check_torch

check_torch()  # before anything else: a torch lacking an API we call fails here naming it; an untested one warns

from zero_strategy.checkpoint.export.consolidate import consolidate  # noqa: E402
from zero_strategy.checkpoint.pretrained.open import load_pretrained  # noqa: E402
from zero_strategy.config import OffloadDevice, ZeroConfig, ZeroConfigError  # noqa: E402
from zero_strategy.core.engine.engine import ZeroEngine  # noqa: E402
from zero_strategy.core.engine.memory import MemoryReport  # noqa: E402
from zero_strategy.core.flat.access import ShardedParameterError  # noqa: E402
from zero_strategy.core.flat.in_place_watch import InPlaceChangeError, InPlaceChangeWarning  # noqa: E402
from zero_strategy.core.stage import ZeroStage  # noqa: E402
from zero_strategy.gradients import grad_norm  # noqa: E402
from zero_strategy.version import library_version  # noqa: E402

__version__ = library_version()

__all__ = [
    "InPlaceChangeError",
    "InPlaceChangeWarning",
    "MemoryReport",
    "OffloadDevice",
    "ShardedParameterError",
    "UntestedTorchWarning",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "ZeroStage",
    "__version__",
    "consolidate",
    "grad_norm",
    "load_pretrained",
]

try:  # the Lightning adapters; the core and the checkpoint tools work without Lightning installed
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError:  # pragma: no cover - Lightning is a dependency; this keeps zero-to-fp32 usable without it
    pass
else:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY

    from zero_strategy.fabric.precision import ZeroFabricPrecision
    from zero_strategy.fabric.strategy import ZeroFabricStrategy
    from zero_strategy.lightning.checkpoint_io import ShardedCheckpointIO
    from zero_strategy.lightning.precision import ZeroPrecision
    from zero_strategy.lightning.strategy import ZeroStrategy

    ZeroStrategy.register_strategies(StrategyRegistry)
    ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
    __all__ += ["ShardedCheckpointIO", "ZeroFabricPrecision", "ZeroFabricStrategy", "ZeroPrecision", "ZeroStrategy"]
