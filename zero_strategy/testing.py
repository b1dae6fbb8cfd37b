"""A small public multi-process harness (README: "Testing your own code on several ranks"), used by this
repository's tests and benchmarks: run a function on N CPU ranks over gloo.

Each rank runs in a forked process with a short process-group timeout and hands its result back through a pipe
of its own. A forked rank is made to start as a fresh process would (see [Note: a forked rank starts fresh]); with
``init_process_group=False`` it finds the environment torchrun gives its ranks and joins no process group itself,
so that the code under test (a strategy's ``setup_environment``) creates it.

The harness watches every pipe and every process at once: a rank that raises is reported with its traceback, a
rank that dies (a signal such as SIGSEGV or SIGKILL, ``os._exit``, a non-zero exit code) is reported as a crash
naming the rank and how it died as soon as its process ends, whether it had handed its result back or not, and
ranks that neither finish nor die are reported after ``timeout_s``. Every rank's exit status is checked before the
results are returned.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from zero_strategy.core.once import forget_all


class RankFailed(RuntimeError):
    """A rank raised, crashed or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# [Note: a forked rank starts fresh]
# A forked rank inherits its parent's memory, which a real rank (torchrun's, spawn's, a script's) never has:
# - launcher variables: a fit launched earlier in the test process left PL_GLOBAL_SEED (seeding every later fit's
#   workers and model), RANK, WORLD_SIZE, MASTER_PORT...; the rank gets them as the test process started with them
#   (LAUNCHER_VARIABLES, from the snapshot taken when this module was first imported), so no result depends on
#   which tests ran before;
# - what was said once per process: Python's once-per-location warning registries and the library's own (see
#   [Note: once per process] in core/once.py); inherited, a warning the parent gave is never given again in the rank,
#   and an assertion that it is (or is not) given tests nothing. Both are emptied;
# - ``atexit`` handlers: a forked process ends by ``os._exit`` and runs none, so the parent's are dropped and the
#   rank's own (the strategies' process-group teardown) run when its function returns, as at a real rank's exit.
LAUNCHER_VARIABLES = frozenset({
    "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "PL_TRAINER_DEVICES", "PL_TRAINER_NUM_NODES", "PL_TRAINER_STRATEGY",
})
"""Environment variables a launcher (Lightning, torchrun, this harness) sets for its ranks."""

STARTING_ENVIRONMENT = {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ}
"""The launcher variables as the process had them when this module was first imported (in a test session: at
collection, before any test ran)."""


def restore_launcher_environment() -> None:
    """Give every launcher variable the value it had at :data:`STARTING_ENVIRONMENT` (unset where it had none)."""
    for name in LAUNCHER_VARIABLES:
        if name in STARTING_ENVIRONMENT:
            os.environ[name] = STARTING_ENVIRONMENT[name]
        else:
            os.environ.pop(name, None)


def forget_warnings_said() -> None:
    """Empty Python's once-per-location warning registries and the library's once-per-process registry."""
    for module in [warnings, *list(sys.modules.values())]:  # warnings.onceregistry: the "once" action's
        for name in ("__warningregistry__", "onceregistry") if module is warnings else ("__warningregistry__",):
            registry = getattr(module, name, None)
            if isinstance(registry, dict):
                registry.clear()
    forget_all()


def _start_fresh() -> None:
    """A forked rank's first act (see [Note: a forked rank starts fresh])."""
    restore_launcher_environment()
    forget_warnings_said()
    atexit._clear()  # the parent's: a real rank never had them


def _torchrun_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun sets for rank ``rank`` of a one-node world (Lightning detects TorchElasticEnvironment)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": f"zero-strategy-testing-{port}"}


@dataclass(frozen=True)
class _RankSetup:
    """How each rank starts: the rendezvous port, the harness's process-group timeout (None: the rank gets
    torchrun's environment and creates no process group itself)."""

    port: int
    pg_timeout_s: float | None


def _rank_entry(fn: Callable[..., Any], rank: int, world_size: int, setup: _RankSetup, pipe: Connection,
                args: tuple) -> None:
    _start_fresh()
    torch.set_num_threads(1)
    try:
        if setup.pg_timeout_s is None:
            os.environ.update(_torchrun_environment(rank, world_size, setup.port))
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(setup.port))
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=setup.pg_timeout_s))
        value = fn(rank, world_size, *args)
        # Serialized by torch.save: pickling tensors for another process would pass them as shared-memory
        # handles that vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        pipe.send(("ok", buffer.getvalue()))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        pipe.close()
        atexit._run_exitfuncs()  # what the rank registered runs as at a real process's exit
        if dist.is_initialized():
            dist.destroy_process_group()


class _Report(Enum):
    """What a rank has handed back through its pipe so far."""

    NOTHING = "nothing"
    RESULT = "result"
    ERROR = "error"


@dataclass
class _Rank:
    """One rank as the parent last saw it: its process, the parent's end of its pipe, what it reported and how
    it ended. Only :meth:`update` changes what is seen, so one pass of the watch judges one consistent state."""

    index: int
    process: BaseProcess
    pipe: Connection
    report: _Report = _Report.NOTHING
    payload: Any = None  # the result's torch.save bytes, or the traceback text
    pipe_open: bool = True
    exit_code: int | None = None  # None while running; negative: the signal that ended it

    def update(self) -> None:
        """Take what the rank sent, then note whether it ended (and read again: what it sent just before)."""
        self._read()
        if self.exit_code is None and not self.process.is_alive():
            self.process.join()
            self.exit_code = self.process.exitcode
            self._read()

    def _read(self) -> None:
        try:
            while self.pipe_open and self.pipe.poll():
                status, self.payload = self.pipe.recv()
                self.report = _Report.RESULT if status == "ok" else _Report.ERROR
        except (EOFError, OSError):  # end of file: the process is gone
            self.pipe_open = False

    @property
    def exited(self) -> bool:
        return self.exit_code is not None

    @property
    def crashed(self) -> bool:
        """Ended by a signal or with a non-zero exit status."""
        return self.exit_code not in (None, 0)

    @property
    def done(self) -> bool:
        """Returned its result and exited with status 0."""
        return self.exit_code == 0 and self.report is _Report.RESULT

    @property
    def failure(self) -> str | None:
        """Why this rank failed, or None while it has not (yet)."""
        code = self.exit_code
        when = "after returning its result" if self.report is _Report.RESULT else "before returning a result"
        if code is not None and code < 0:
            return f"rank {self.index} crashed: killed by signal {_signal_name(-code)} ({when})"
        if code is not None and code > 0:
            return f"rank {self.index} crashed: exited with code {code} ({when})"
        if self.report is _Report.ERROR:
            return f"rank {self.index} raised:\n{self.payload}"
        if code == 0 and self.report is _Report.NOTHING:
            return f"rank {self.index} exited (code 0) without returning a result (os._exit in the function?)"
        return None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    pg_timeout_s: float = 30.0,
    survivors_grace_s: float = 0.0,
    init_process_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``init_process_group``: join the ranks in a gloo process group before ``fn`` (timeout ``pg_timeout_s``); False
    gives each rank torchrun's environment instead (RANK, WORLD_SIZE, MASTER_PORT, TORCHELASTIC_RUN_ID...) for
    the code under test to create the process group, as under torchrun.

    Raises :class:`RankFailed` as soon as a rank raises or dies, or after ``timeout_s`` if ranks are still running.
    ``survivors_grace_s``: after a failure, wait up to this long for the other ranks to finish or fail too and
    report them as well (a test of how survivors react to a crashed peer); by default they are stopped at once.
    """
    ctx = mp.get_context("fork")
    setup = _RankSetup(free_port(), pg_timeout_s if init_process_group else None)
    ranks: list[_Rank] = []
    try:
        for index in range(world_size):
            # One pipe per rank, made just before its fork: only that rank holds the writing end, so its death
            # closes the pipe.
            parent_end, child_end = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_rank_entry, args=(fn, index, world_size, setup, child_end, args), daemon=True
            )
            process.start()
            child_end.close()
            ranks.append(_Rank(index, process, parent_end))
        _watch(ranks, time.monotonic() + timeout_s, timeout_s, survivors_grace_s)
    finally:
        for rank in ranks:  # every rank has exited on success; on failure the rest are stopped now
            if rank.process.is_alive():
                rank.process.kill()
            rank.process.join()
            rank.pipe.close()
    return [torch.load(io.BytesIO(rank.payload), weights_only=False) for rank in ranks]


def _watch(ranks: list[_Rank], deadline: float, timeout_s: float, survivors_grace_s: float) -> None:
    """Wait until every rank returned its result and exited with status 0; raise RankFailed at the first failure
    (after ``survivors_grace_s`` for the others), or at the deadline."""
    failed_at = float("inf")  # when the first failure was seen
    while not all(rank.done for rank in ranks):
        # crashes first: a peer's death is the likely cause of the errors it provokes in the others
        failed = sorted((r for r in ranks if r.failure is not None), key=lambda r: not r.crashed)
        failures = [str(r.failure) for r in failed]
        if failures:
            failed_at = min(failed_at, time.monotonic())
        window = _failure_window(ranks, survivors_grace_s)
        if failures and (time.monotonic() >= failed_at + window or all(r.exited for r in ranks)):
            raise RankFailed("\n".join(failures))
        end = min(deadline, failed_at + window)
        watched = [r.pipe for r in ranks if r.pipe_open] + [r.process.sentinel for r in ranks if not r.exited]
        if not watched:  # every pipe closed and every process ended since the checks above: judge them again
            continue
        if not wait(watched, timeout=max(0.0, end - time.monotonic())) and time.monotonic() >= deadline:
            raise RankFailed(_hang_message(ranks, timeout_s) + "".join(f"\n{f}" for f in failures))
        for rank in ranks:
            rank.update()


_CRASH_ATTRIBUTION_S = 2.0
"""How long a rank's error waits for a peer's crash to show before it is reported alone: a peer that dies in a
collective makes the others raise ("connection closed by peer") about when its own death becomes visible, and the
death, not the error it provoked, is what the report must lead with."""


def _failure_window(ranks: list[_Rank], survivors_grace_s: float) -> float:
    """Seconds from the first failure to the report: at least the attribution window until some rank crashed."""
    if any(rank.crashed for rank in ranks):
        return survivors_grace_s
    return max(survivors_grace_s, _CRASH_ATTRIBUTION_S)


def _hang_message(ranks: list[_Rank], timeout_s: float) -> str:
    running = [r.index for r in ranks if r.report is _Report.NOTHING and not r.exited]
    lingering = [r.index for r in ranks if r.report is _Report.RESULT and not r.exited]
    parts = [f"rank(s) {running} did not finish within {timeout_s:.0f} s (hang?)"] if running else []
    if lingering:
        parts.append(f"rank(s) {lingering} returned their results but had not exited within {timeout_s:.0f} s")
    return "; ".join(parts)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_in_process(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks simulated by threads of this process (no process
    group: an engine built inside ``fn`` without one shards over the simulated world; see
    zero_strategy/core/comm/in_process.py for what this can and cannot simulate). Returns the per-rank results in
    rank order; the first rank's exception is raised."""
    from zero_strategy.core.comm.group import simulated_rank
    from zero_strategy.core.comm.in_process import InProcessWorld

    world = InProcessWorld(world_size, timeout_s=timeout_s)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def rank_main(rank: int) -> None:
        try:
            with simulated_rank(world.group(rank)):
                results[rank] = fn(rank, world_size, *args)
        except BaseException as error:  # handed to the caller; the peers' waits fail at once
            errors.append((rank, error))
            world.abort(f"rank {rank}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if any(thread.is_alive() for thread in threads):
        world.abort("the harness timed out")
        raise RankFailed(f"simulated ranks did not finish within {timeout_s:.0f} s (hang?)")
    if errors:
        rank, error = errors[0]  # the first to fail: its peers' errors follow from it
        raise RankFailed(f"rank {rank} raised: {type(error).__name__}: {error}") from error
    return results
