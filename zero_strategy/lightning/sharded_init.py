"""The Trainer's side of sharded construction: what it says when parameters stay sharded after a run, and how
Lightning's teardown leaves meta parameters alone. The construction recording (core/init/construction_recorder.py)
and the initial values (zero_strategy/initial_values.py) are shared with the Fabric adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn


def warn_parameters_stay_sharded(stage: int) -> None:
    rank_zero_warn(
        f"The model was built sharded at stage {stage}, so its parameters stay sharded after this run (the "
        "module's parameters are on the meta device; gathering them would put the whole model on every rank). "
        "trainer.save_checkpoint(path) writes them, `zero-to-fp32 path out.safetensors` consolidates them, and a "
        "further fit/validate/test on this Trainer continues from them. Set full_params_after_fit=True to gather "
        "full parameters on every rank instead."
    )


@contextmanager
def meta_parameters_stay(module: nn.Module | None) -> Iterator[None]:
    """Within the block, ``module.cpu()`` moves everything but meta tensors (Lightning's ``Strategy.teardown``
    calls it; a meta tensor cannot be copied, and a parameter left sharded is meta on purpose)."""
    if module is None or not any(param.is_meta for param in module.parameters()):
        yield
        return

    def cpu_except_meta() -> nn.Module:
        return module._apply(lambda tensor: tensor if tensor.is_meta else tensor.cpu())

    module.cpu = cpu_except_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu
