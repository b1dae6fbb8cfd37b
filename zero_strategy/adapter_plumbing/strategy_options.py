"""What a ZeRO strategy's constructor makes of its arguments, the same for the Trainer's ZeroStrategy and the
ZeroFabricStrategy: the ZeroConfig (``config=`` or its fields as keywords, ``stage`` first) and the activation
checkpointing policy, which may hold module classes or a callable the config cannot (config files hold names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zero_strategy.config import ZeroConfig
from zero_strategy.core.runtime.activation_checkpointing import CheckpointPolicy, make_policy

START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass(frozen=True)
class StrategyOptions:
    config: ZeroConfig
    checkpoint_policy: CheckpointPolicy | None  # None: no activation checkpointing


def strategy_options(stage: int | None, config: ZeroConfig | None, start_method: str,
                     options: dict[str, Any]) -> StrategyOptions:
    """Check the arguments and build the config; each bad one is an error naming it."""
    if config is not None and options:
        raise ValueError(f"pass ZeRO options either as config= or as keywords, not both (got {sorted(options)})")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}: use 'popen', 'spawn', 'fork' or 'forkserver'")
    options = dict(options)
    # module classes or a policy callable stay out of the config; class names go into it
    checkpointing = options.pop("activation_checkpointing", None)
    if isinstance(checkpointing, (list, tuple)) and all(isinstance(item, str) for item in checkpointing):
        options["activation_checkpointing"] = list(checkpointing)
        checkpointing = None
    if config is None:
        config = ZeroConfig.from_kwargs(**({"stage": stage} if stage is not None else {}), **options)
    elif stage is not None and stage != config.stage:
        raise ValueError(f"stage={stage} disagrees with config.stage={config.stage}")
    spec = checkpointing if checkpointing is not None else config.activation_checkpointing
    return StrategyOptions(config, make_policy(spec))
