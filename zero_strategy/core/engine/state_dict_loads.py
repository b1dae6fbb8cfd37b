"""``module.load_state_dict(full_state_dict)`` of a sharded module writes the values into the master slices.

[Note: loading a full state dict into the shards]
torch's ``load_state_dict`` copies each value into the module's parameter, which under ZeRO is not where the weights
live: at stage 3 the parameter holds no values between uses (the copy raises, see [Note: parameters outside
forward]), and at stages 1/2 under bf16/fp16 or offload the next step overwrites it from the fp32 masters. Code
written for one process or for DDP calls it anyway (litgpt's ``load_checkpoint`` for any strategy but FSDP). So
the engine hooks every module's ``load_state_dict``: each parameter it owns is taken out of the state dict before
torch sees it, this rank's element ranges of the given value are written into the master slices (in the masters'
dtype: an fp32 file loads into fp32 masters unrounded), its shape is checked as torch checks it, and its key is
not reported missing. Buffers load as torch loads them. Before the first write every rank waits for its peers to be
done reading the host-wide parameters (stage 3 on one host), and when the outermost call returns the slices are
published to the module (stages 1/2 gather them), so it is a collective: every rank loads, as under DDP.
``assign=True`` would replace the parameter objects the engine owns, and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.overrides import is_tensor_like
from torch.utils.hooks import RemovableHandle

from zero_strategy.core.flat.flat_param import FlatParam
from zero_strategy.core.flat.whole import own_parts
from zero_strategy.core.plan.tensor_parallel import is_distributed, local_part
from zero_strategy.core.runtime.owned_hook import OwnedHook


class StateDictLoads:
    """Installs and owns the ``load_state_dict`` hooks of one engine (see [Note: loading a full state dict into the
    shards])."""

    def __init__(self, module: nn.Module, flats: list[FlatParam], before_load: Callable[[], None],
                 after_load: Callable[[], None]) -> None:
        self._owner_of = {id(param): (flat, index) for flat in flats for index, param in enumerate(flat.params)}
        self._before_load, self._after_load = before_load, after_load
        self._handles: list[RemovableHandle] = []
        self._depth = 0
        self._taken: set[str] = set()  # keys written into the slices during the current outermost call
        for sub in module.modules():
            # OwnedHook: a deep copy of the module gets inert hooks, not this engine (core/runtime/owned_hook.py)
            self._handles.append(sub.register_load_state_dict_pre_hook(OwnedHook(self._before)))
            self._handles.append(sub.register_load_state_dict_post_hook(OwnedHook(self._after)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
        strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        self._depth += 1
        for name, param in module._parameters.items():
            owner = self._owner_of.get(id(param)) if param is not None else None
            key = prefix + name
            if param is None or owner is None or key not in state_dict:
                continue
            if local_metadata.get("assign_to_params_buffers", False):
                raise RuntimeError(
                    f"load_state_dict(assign=True) would replace {key}, a parameter ZeRO shards; load without "
                    "assign (the values are written into this rank's slices)."
                )
            value = state_dict.pop(key)
            if not self._taken:
                self._before_load()  # every rank: peers done reading the slices this writes
            self._taken.add(key)
            if is_distributed(param) and not is_distributed(value):
                error_msgs.append(f"{key} is a tensor-parallel parameter (a DTensor) and the value is a plain "
                                  "tensor: load the DTensor its state_dict() gives, or load before "
                                  "parallelize_module, or resume through a checkpoint.")
                continue
            if not is_tensor_like(value) or tuple(value.shape) != tuple(param.shape):  # lazily loaded ones too
                shape = tuple(value.shape) if is_tensor_like(value) else type(value).__name__
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                                  f"the shape in current model is {tuple(param.shape)}.")
                continue
            # a tensor-parallel parameter: its own block of a DTensor value (a full value of the global shape would
            # need the plan's split: load_state_dict it before parallelize_module, or through a checkpoint)
            _write_own_ranges(*owner, local_part(value) if is_distributed(param) else value)

    def _after(self, module: nn.Module, incompatible_keys: Any) -> None:
        missing = incompatible_keys.missing_keys
        missing[:] = [key for key in missing if key not in self._taken]
        self._depth -= 1
        if self._depth == 0:
            taken, self._taken = self._taken, set()
            if taken:
                self._after_load()  # every rank: the slices reach the module (stages 1/2 gather them)


def _write_own_ranges(flat: FlatParam, index: int, value: Tensor) -> None:
    """This rank's element ranges of parameter ``index`` of ``flat`` from its whole ``value``."""
    for overlap, part in own_parts(flat, flat.names[index], value):
        flat.write_shard_range(index, overlap.param_start, part.detach().to(flat.shard.device))
