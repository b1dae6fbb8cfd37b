"""The process group this strategy created is destroyed while the interpreter is still whole, at exit.

[Note: destroying the process group at exit]
A script launched once per rank (the plain strategy names, torchrun, SLURM) goes on after ``fit`` (saving,
``test``, another ``fit``), so teardown cannot destroy the process group. Left to interpreter finalization, gloo's
worker threads may still hold finished work objects that reference tensors; freeing those then needs the GIL of an
interpreter being torn down, and the process dies by SIGABRT ("terminate called without an active exception")
after all its work succeeded: exit status -6, a failed job. Seen here now and then (the README example's test, a
popen-launched script, in CI; the spawn path already destroys the group in teardown). So when the strategy creates
the default process group it registers an ``atexit`` handler that destroys it, a no-op when the user or the spawn
teardown already did. Destroying is local to each rank (no collective): a rank that exits first waits for nobody.
"""

from __future__ import annotations

import atexit
import warnings

import torch.distributed as dist

from zero_strategy.core.once import first_time


def destroy_process_group_at_exit() -> None:
    """Register (once per process, see [Note: once per process] in core/once.py) the ``atexit`` handler that destroys
    the default process group."""
    if first_time("destroy the process group at exit"):
        atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as error:  # the process is exiting: say so, but do not change its exit status
        warnings.warn(f"zero_strategy: destroying the process group at exit failed: {error!r}", stacklevel=1)
