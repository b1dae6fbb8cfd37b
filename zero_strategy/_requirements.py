"""What zero_strategy needs of torch, checked when the package is imported.

[Note: which torch imports]
- The torch CI tests (:data:`TESTED_TORCH`, the range pyproject.toml states): imported silently.
- Another torch that has every API the code calls (:data:`REQUIRED_FEATURES`): imported, with one
  :class:`UntestedTorchWarning` naming the tested version and what may differ. Most clusters run an older torch
  than the newest, so an untested torch is allowed, never silently.
- A torch lacking one of those APIs: an ImportError naming the API and the torch that has it, here at import rather
  than in the middle of the first training step.
The APIs are found by looking at them (a function's parameters, a module's attributes), never by comparing version
numbers, so a torch build with a back-ported API, or an unusual version string, is judged by what it has. A profiler
or logger that replaces ``torch.distributed.isend`` with a wrapper must not make a current torch look old:
signatures are read on the defining module (``torch.distributed.distributed_c10d``), through ``__wrapped__``
(``functools.wraps``), and a bare ``(*args, **kwargs)`` wrapper is taken as "cannot tell", not as "missing".
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zero_strategy.core.once import first_time

TESTED_TORCH = (2, 13)
"""The torch minor version the test suite runs on (CI pins torch==2.13.0)."""

SUPPORTED_TORCH = "torch>=2.13,<2.14"
"""The range pyproject.toml states: the tested one (tests/unit/test_requirements.py holds the two in agreement)."""


class UntestedTorchWarning(UserWarning):
    """zero_strategy was imported with a torch other than the one its tests run on."""


@dataclass(frozen=True)
class TorchFeature:
    """One torch API the code calls: how to find it, and which torch has it."""

    api: str  # as a user would look it up
    since: str  # a torch release that has it (the oldest we know of)
    used_for: str
    present: Callable[[], bool]


def _accepts_keyword(module: str, function: str, keyword: str) -> Callable[[], bool]:
    def present() -> bool:
        found: object = importlib.import_module(module)
        for part in function.split("."):
            found = getattr(found, part, None)
            if found is None:
                return False
        try:
            parameters = inspect.signature(inspect.unwrap(found)).parameters  # type: ignore[arg-type]
        except (TypeError, ValueError):  # no signature to read (a C function, an odd wrapper): cannot tell
            return True
        if keyword in parameters:
            return True
        # a wrapper without functools.wraps: (*args, **kwargs) says nothing about what it calls
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    return present


def _has(module: str, *names: str) -> Callable[[], bool]:
    def present() -> bool:
        try:
            found = importlib.import_module(module)
        except ImportError:
            return False
        for name in names:
            owner = found
            for part in name.split("."):
                if not hasattr(owner, part):
                    return False
                owner = getattr(owner, part)
        return True

    return present


_DCP = "torch.distributed.checkpoint"
REQUIRED_FEATURES: tuple[TorchFeature, ...] = (
    TorchFeature("torch.distributed.isend(..., group_dst=)", "2.6", "point-to-point gathers and reductions",
                 _accepts_keyword("torch.distributed.distributed_c10d", "isend", "group_dst")),
    TorchFeature("torch.distributed.irecv(..., group_src=)", "2.6", "point-to-point gathers and reductions",
                 _accepts_keyword("torch.distributed.distributed_c10d", "irecv", "group_src")),
    TorchFeature("torch.compiler.disable(..., reason=)", "2.8", "stage 3's hooks under torch.compile",
                 _accepts_keyword("torch.compiler", "disable", "reason")),
    TorchFeature("torch.distributed.reduce_scatter_tensor, all_gather_into_tensor", "2.0",
                 "the backend's collectives (collectives='native')",
                 _has("torch.distributed", "reduce_scatter_tensor", "all_gather_into_tensor")),
    TorchFeature("Tensor.register_post_accumulate_grad_hook", "2.1", "reducing gradients as backward produces them",
                 _has("torch", "Tensor.register_post_accumulate_grad_hook")),
    TorchFeature("nn.Module.register_forward_hook(..., always_call=)", "2.1", "stage 3's gathers around forward",
                 _accepts_keyword("torch.nn", "Module.register_forward_hook", "always_call")),
    TorchFeature("nn.Module.register_state_dict_post_hook, register_load_state_dict_pre_hook", "2.5",
                 "state_dict() and load_state_dict() of a sharded module",
                 _has("torch.nn", "Module.register_state_dict_post_hook", "Module.register_load_state_dict_pre_hook",
                      "Module.register_load_state_dict_post_hook", "Module.register_state_dict_pre_hook")),
    TorchFeature("torch.utils.swap_tensors, torch.get_default_device", "2.3", "sharded construction on meta",
                 _has("torch", "utils.swap_tensors", "get_default_device")),
    TorchFeature("torch.nn.RMSNorm", "2.4", "the normalization layers kept whole", _has("torch.nn", "RMSNorm")),
    TorchFeature("torch.distributed.checkpoint (StorageMeta, create_read_items_for_chunk_list, FileSystemWriter)",
                 "2.4", "checkpoint_format='dcp'",
                 lambda: _has(f"{_DCP}.metadata", "StorageMeta", "ChunkStorageMetadata", "TensorProperties")()
                 and _has(f"{_DCP}.planner_helpers", "create_read_items_for_chunk_list")()
                 and _has(f"{_DCP}.filesystem", "_StorageInfo", "FileSystemWriter", "FileSystemReader")()),
)
"""Every torch API the code calls that older releases lack (tests/unit/test_requirements.py)."""


def parse_torch_version(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version (``"2.13.0+cpu"``, ``"2.14.0a0+git1234"``), None if unreadable."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def missing_features(features: Sequence[TorchFeature] = REQUIRED_FEATURES) -> list[TorchFeature]:
    return [feature for feature in features if not feature.present()]


def check_torch(version: str | None = None, features: Sequence[TorchFeature] = REQUIRED_FEATURES) -> None:
    """Refuse a torch lacking an API the code calls; warn once about a torch the tests do not run on (see [Note:
    which torch imports]). ``version``: torch's own ``torch.__version__`` by default."""
    found = str(torch.__version__ if version is None else version)
    missing = missing_features(features)
    if missing:
        lines = [f"  {f.api} (for {f.used_for}): torch >= {f.since} has it" for f in missing]
        raise ImportError(
            f"zero_strategy cannot run on torch {found}, which lacks:\n" + "\n".join(lines) + "\nInstall the torch "
            f"the tests run on: pip install '{SUPPORTED_TORCH}'"
        )
    if parse_torch_version(found) != TESTED_TORCH and first_time(("untested torch", found)):
        warnings.warn(_untested_message(found), UntestedTorchWarning, stacklevel=2)


def _untested_message(found: str) -> str:
    from zero_strategy.core.init.profile_hook import BLACK_BOX_CODES

    tested = ".".join(str(part) for part in TESTED_TORCH)
    skipping = ", ".join(sorted(f"nn.init.{fn.__name__}" for fn in BLACK_BOX_CODES.values())) or "none"
    return (
        f"zero_strategy is tested with torch {tested}, not torch {found}: it has every torch API the code calls, but "
        "behaviour may differ where the code depends on torch's internals. Sharded construction (a model built on "
        "the meta device) recognises the nn.init functions that skip meta tensors by their code; in this torch it "
        f"found: {skipping}. A function that "
        "skips meta tensors in another way would leave its parameters uninitialised: compare a sharded build with a "
        f"plain one before training. For the tested setup: pip install '{SUPPORTED_TORCH}'."
    )
