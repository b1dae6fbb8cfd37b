"""Where a tensor-parallel parameter's whole value comes from when its plan was applied during the recorded build.

[Note: tensor-parallel parameters built on the meta device]
A ``configure_model`` that builds the model (on the meta device, recorded) and then applies a tensor-parallel plan
(``parallelize_module``) replaces each planned parameter by a new ``nn.Parameter(DTensor)``: its local tensor is a
meta tensor that DTensor's own code made (``empty_like`` then a scatter from the plan's source rank, which meta
tensors skip), so replaying the ops behind it gives no values. What the recording does know is the whole tensor the
DTensor was distributed from: the parameter it replaced. While recording, a module-parameter registration hook
notes, for every DTensor parameter with a meta local tensor that replaces a recorded meta parameter of the same
global shape, that origin (followed through a parameter distributed twice). Replay then hands over the origin's
whole value, bit for bit the eager build's, and the engine keeps this rank's TP block of it
(``local_block``, core/plan/tensor_parallel.py) and, of that, its ZeRO range: every rank replays the same values, so
no TP block is sent anywhere, and the replay keeps a few whole tensors at once, never the model. A build
that writes a DTensor parameter after the plan made it, or the parameter it replaced after the distribution, is
refused by name (replay_steps.py): the DTensor's values would then not be a block of that parameter's final value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from zero_strategy.core.init.ops import TensorRef
from zero_strategy.core.plan.tensor_parallel import is_distributed, local_part


@dataclass(frozen=True, slots=True)
class Origin:
    """The recorded tensor a DTensor parameter was distributed from, and the last recorded op before (None: none)."""

    ref: TensorRef
    after: object | None  # the RecordedOp; a later write of `ref`'s storage is not in the DTensor's values


class DistributedOrigins:
    """For each DTensor parameter made from a recorded meta parameter during the build: that parameter's ref."""

    def __init__(self) -> None:
        # id -> (the parameter, kept so that its id is never reused; its origin). Not weak references: a tensor
        # with one cannot be swapped (torch.utils.swap_tensors), and the FlatParams swap parameters.
        self._origins: dict[int, tuple[Tensor, Origin]] = {}

    def __len__(self) -> int:
        return len(self._origins)

    def of(self, tensor: Tensor) -> Origin | None:
        """Where ``tensor`` (a DTensor parameter) was distributed from, or None."""
        held = self._origins.get(id(tensor))
        return held[1] if held is not None and held[0] is tensor else None

    def note(self, new: Tensor, origin: Origin) -> None:
        self._origins[id(new)] = (new, origin)


@contextmanager
def noting_distributed_origins(
    origins: DistributedOrigins, recorded: Callable[[Tensor], TensorRef | None], last_op: Callable[[], object | None]
) -> Iterator[None]:
    """While the build runs: note the origin of every DTensor parameter that replaces a recorded meta one
    (``recorded``: a meta tensor's ref if the recording saw its storage made, else None; ``last_op``: the last op
    recorded so far)."""

    def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        old = module._parameters.get(name)
        if param is None or old is None or not is_distributed(param) or not local_part(param).is_meta:
            return
        earlier = origins.of(old) if is_distributed(old) else None
        ref = earlier.ref if earlier is not None else recorded(old)
        if ref is not None and tuple(param.shape) == ref.size:  # the global shape of what was distributed
            origins.note(param, Origin(ref, last_op()))

    handle = register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
