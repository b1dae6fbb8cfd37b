"""Deferred initialization: build a model on the meta device, then replay its initialization one value at a time.

Design ("sharded construction"):

* Recording (`record_construction`): construction runs with tensors defaulting to the meta device while a
  `TorchDispatchMode` writes down every aten op that touches a meta tensor. A tensor is described by its storage
  (an id) and its view of it, so views, `.data` and `param.data = ...` need no special care: what counts is which
  storage a parameter ends up in. Real tensors an op reads (a CPU tensor copied into a parameter) are kept by
  reference. The generators' states are taken at entry, and every reseed inside the build (`torch.manual_seed`,
  `set_rng_state`, a `fork_rng` restore, `Generator.manual_seed`/`set_state`) becomes a step of the recording
  (see [Note: reseeds inside the build] in generators.py). A random op on a real tensor, or reading values
  (`.item()`, `bool()`, `.tolist()`, numpy), is an error naming the module code, never silently different
  values. `nn.init` functions that skip meta tensors in torch 2.13 are recorded as whole calls.
* Scheduling (`ModuleReplay`): a backward liveness pass over the ops (see [Note: replay liveness] in replay_steps.py)
  decides per op: run on real storage, run on scratch (random, result never read: only its draws matter), or skip.
* Replay (`ModuleReplay.replay`): the generator is reset to the recorded state and the live ops run in order on
  real tensors; each parameter/buffer value is handed to a callback as soon as its last write is done, then
  freed. Every random op and generator step runs, so values and the final generator states equal an eager
  build's, bit for bit. Tensors the module holds besides parameters and buffers (torchmetrics states, plain
  tensor attributes: see [Note: attribute tensors] in attribute_tensors.py) get their values in place.
  `peak_bytes` counts the storages replay keeps at once (a few tensors, not the model).
* `materialize_module` replays into the module itself, keeping Parameter identity and ties.
"""

from zero_strategy.core.init.capture import record_construction
from zero_strategy.core.init.ops import DeferredInitError
from zero_strategy.core.init.record import Recording
from zero_strategy.core.init.replay import ModuleReplay, ReplayStats, materialize_module
from zero_strategy.core.init.replay_steps import FinalTensor
from zero_strategy.core.init.resets import record_resets

__all__ = [
    "DeferredInitError",
    "FinalTensor",
    "ModuleReplay",
    "Recording",
    "ReplayStats",
    "materialize_module",
    "record_construction",
    "record_resets",
]
