"""Materializing a meta-built model the way FSDP does: every module's ``reset_parameters()``.

[Note: the reset_parameters contract]
Two contracts give a model built on the meta device its values. Ours by default replays the recorded construction
(bit for bit what an eager build gives). FSDP's calls each module's ``reset_parameters()`` when it materializes
the model, and code written for FSDP relies on it: litgpt's pretraining builds ``GPT`` under
``init_module(empty_init=True)``, swaps in its own initializers as ``reset_parameters`` attributes and, for any
strategy but FSDP, calls them itself on the meta model (where they compute nothing; its rope cache is remade on
the meta device, outside the recording). With ``meta_init="reset_parameters"`` the construction is replayed and
then every module's ``reset_parameters()`` (those that have one, in ``module.modules()`` order: what litgpt's
``reset_parameters(model)`` does on a real model under DDP) runs as part of the same recording, starting from
the generators' states at the moment the model is sharded. The values are therefore what DDP gets from the same
calls on a real model at that moment, bit for bit, and a module without ``reset_parameters`` keeps its replayed
construction (FSDP leaves it uninitialized). ``reset_parameters`` must compute from shapes, as on any meta model.
"""

from __future__ import annotations

from torch import nn

from zero_strategy.core.init.capture import continue_recording
from zero_strategy.core.init.record import Recording


def record_resets(module: nn.Module, recording: Recording) -> None:
    """Append every ``reset_parameters()`` call of ``module``'s submodules (in module order) to ``recording``, as
    if they ran now (see [Note: the reset_parameters contract])."""
    with continue_recording(recording, "reset_parameters() when the model is sharded"):
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
