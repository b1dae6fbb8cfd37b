"""Which dtype each parameter computes in under mixed precision, and which dtype gradients are reduced in.

[Note: fp32 normalization layers]
On a CPU, torch's layer_norm refuses fp16 parameters even under autocast ("mixed dtype (CPU): expect parameter to
have scalar type of Float"), and normalization statistics are where low precision hurts most anyway. So the
parameters of normalization layers compute in fp32 (a common mixed-precision policy); everything else computes
in the low-precision dtype, and the forward runs under autocast so that fp32 tensors a model creates at run time
(positional encodings, masks) mix correctly with low-precision weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

NORMALIZATION_LAYERS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Compute in ``param_dtype`` (norm layers in fp32), keep fp32 masters, reduce gradients in ``reduce_dtype``."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype = torch.float32
    fp32_modules: tuple[type[nn.Module], ...] = field(default=NORMALIZATION_LAYERS)

    def compute_dtype_for(self, param: nn.Parameter) -> torch.dtype:
        return self.param_dtype if param.is_floating_point() else param.dtype

    def full_precision_params(self, module: nn.Module) -> set[int]:
        """ids of parameters under ``module`` that stay fp32 (see [Note: fp32 normalization layers])."""
        return {
            id(param)
            for sub in module.modules()
            if isinstance(sub, self.fp32_modules)
            for param in sub.parameters(recurse=False)
        }
