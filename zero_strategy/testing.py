"""A small public multi-process harness (README: "Testing your own code on several ranks"), used by this
repository's tests and benchmarks: run a function on N CPU ranks over gloo.

Each rank runs in a forked process with a short process-group timeout; the harness waits at most
``timeout_s`` and kills every rank if one raises or hangs, re-raising the failing rank's traceback.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank raised, crashed or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_entry(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any, pg_timeout_s: float, args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        value = fn(rank, world_size, *args)
        # Serialized by torch.save: torch's queue pickler would pass tensors as shared-memory handles that
        # vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0, pg_timeout_s: float = 30.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the per-rank results in rank order."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, rank, world_size, port, results, pg_timeout_s, args), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(collected))
                raise RankFailed(f"rank(s) {missing} did not finish within {timeout_s:.0f} s (hang?)") from None
            if status == "error":
                raise RankFailed(f"rank {rank} raised:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[rank] for rank in range(world_size)]


def run_in_process(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks simulated by threads of this process (no process
    group: an engine built inside ``fn`` without one shards over the simulated world; see
    zero_strategy/core/comm/in_process.py for what this can and cannot simulate). Returns the per-rank results in
    rank order; the first rank's exception is raised."""
    from zero_strategy.core.comm.in_process import InProcessWorld
    from zero_strategy.core.plan.topology import simulated_rank

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
