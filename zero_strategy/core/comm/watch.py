"""Stage 3 with network gathers: a wait that can never complete becomes an error on every rank within seconds.

[Note: diverging gathers]
At stage 3 a unit is gathered when this rank's forward or backward reaches it. On one host's CPUs nothing is
exchanged (the parameters are read in place from shared memory), but through the network
(``collectives="point_to_point"`` or ``"native"``, several hosts) every rank must take part in every gather. A rank
whose forward calls a module its peers do not call (rank-dependent routing to experts that are separate units)
gathers alone: nothing can ever complete that exchange.

Three defences, all off the common path:
- gather tags carry the unit (a checksum of the gather's label), so two ranks' gathers of *different*
  units never pair up, even when the units have the same size: divergence can only make ranks wait, never mix
  bytes;
- every wait of the step (gathers, reductions, and the few engine collectives in between) runs in a waiter thread
  and is watched. A wait that lasts longer than ``patience_s`` publishes, through the process group's store, what
  this rank waits for and how many exchanges of each kind it has posted, then polls the peers' entries. When every
  rank is stuck, their entries are stable over two polls, and no rank's wait can be satisfied by what its peers
  have posted, the ranks are deadlocked: each raises :class:`DivergedGathersError` naming the units and the remedy.
  A merely slow peer (still computing, or a large gather on a slow link) is not stuck or has posted the exchange,
  so it only makes us wait longer.
- once per optimizer step, inside the step's agreement, the ranks compare a checksum of the units they gathered
  since the last step (16 bytes): with ``collectives="native"`` gloo's own collectives cannot carry the unit, so
  equal-sized gathers of different units would pair up; the step is then refused on every rank.
A peer blocked somewhere the engine does not watch (a collective of the user's own) never publishes: then the
process group's timeout still applies. The waiter thread belongs to the watch, and the watch to its engine's Comm:
:meth:`GatherWatch.close` (the engine's release, or the engine being collected) stops and joins it.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from enum import Enum, auto
from typing import Any, TypeVar

import torch.distributed as dist

from zero_strategy.core.comm.comm import OUTSIDE_FORWARD, DivergedGathersError

__all__ = ["DivergedGathersError", "GatherWatch", "WatchState", "remedy"]

PATIENCE_S = 5.0
"""A wait longer than this consults the peers: long enough that a healthy step never reaches it on a loaded CI
machine, short enough that a diverged run stops within seconds."""
POLL_S = 0.5

T = TypeVar("T")
KINDS = ("gather", "reduce", "collective")  # exchanges counted separately: each kind has its own order


_STOP = object()  # the job that ends the waiter thread


class WatchState(Enum):
    """Whether the watch's waiter thread runs."""

    RUNNING = auto()
    CLOSED = auto()


class GatherWatch:
    """Counts the exchanges this rank posts and watches every wait; see [Note: diverging gathers]."""

    def __init__(self, rank: int, world_size: int, key: str, patience_s: float = PATIENCE_S) -> None:
        self.rank = rank
        self.world_size = world_size
        self.patience_s = patience_s
        self._store: Any = dist.distributed_c10d._get_default_store()
        self._prefix = f"zero-gather-watch/{key}/"
        self.posted = dict.fromkeys(KINDS, 0)
        self.history: deque[tuple[int, str]] = deque(maxlen=64)  # (gather number, unit) of the latest gathers
        self._episode = 0
        self.fingerprint = 0  # checksum of the units gathered since the last take_fingerprint
        self.verdict: str | None = None  # why the ranks diverged, once they did: every later wait raises it
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="zero-gather-watch", daemon=True)
        self._thread.start()
        self.state = WatchState.RUNNING

    def close(self) -> None:
        """Stop the waiter thread and wait for it to end. Idempotent."""
        if self.state is WatchState.CLOSED:
            return
        self.state = WatchState.CLOSED
        self._jobs.put(_STOP)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def post(self, kind: str, what: str) -> int:
        """Count an exchange of ``kind`` this rank just posted; its number (the same on every rank that agrees)."""
        number = self.posted[kind]
        self.posted[kind] += 1
        if kind == "gather":
            self.history.append((number, what))
            self.fingerprint = zlib.crc32(what.encode(), self.fingerprint)
        return number

    def take_fingerprint(self) -> int:
        """The checksum of the units gathered since the last call (then reset): ranks that gathered the same
        units in the same order have the same one."""
        fingerprint, self.fingerprint = self.fingerprint, 0
        return fingerprint

    def wait(self, kind: str, number: int, what: str, wait: Callable[[], T]) -> T:
        """``wait()`` in the waiter thread; past the patience, find out whether the peers can ever answer."""
        if self.state is WatchState.CLOSED:
            raise RuntimeError("the divergence watch was closed with its engine; this exchange belongs to no engine")
        self.raise_if_diverged(what)
        outcome: list[Any] = []
        done = threading.Event()
        self._jobs.put((wait, outcome, done))
        if not done.wait(self.patience_s):
            self._while_stuck(done, (kind, number, what))
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[1]  # type: ignore[no-any-return]

    def raise_if_diverged(self, what: str) -> None:
        """After a verdict nothing more can be exchanged (the waiter thread is still stuck in the exchange that
        diverged, and the peers are stopping): any later exchange (a teardown's gather) raises the verdict again."""
        if self.verdict is not None:
            raise DivergedGathersError(f"{self.verdict} (an earlier exchange of this engine diverged: {what} cannot "
                                       "run)")

    def call(self, what: str, collective: Callable[[], T]) -> T:
        """Post and wait for a blocking collective of the engine's own (agreement, buffer broadcast)."""
        return self.wait("collective", self.post("collective", what), what, collective)

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            job, outcome, done = item
            try:
                outcome += [None, job()]
            except BaseException as error:  # handed to the waiting caller
                outcome.append(error)
            # Drop the job (and what its closure holds, e.g. the tensor a collective filled) before the caller
            # wakes: otherwise it would stay alive in this thread until the next job arrives.
            del job, outcome, item
            done.set()

    # --------------------------------------------------------------------------------------- when stuck
    def _while_stuck(self, done: threading.Event, waiting: tuple[str, int, str]) -> None:
        self._episode += 1
        own = {"episode": self._episode, "waiting": list(waiting), "posted": self.posted,
               "history": list(self.history)}
        self._store.set(self._key(self.rank), json.dumps(own))
        previous: list[dict] | None = None
        while not done.wait(POLL_S):
            try:
                verdict = self._verdict(previous)
                if verdict is not None:
                    self._agree_to_stop(verdict)
                    self.verdict = verdict
                    raise DivergedGathersError(verdict)
                previous = self._read_all()
            except RuntimeError as error:  # the store's host (rank 0's process) is gone: a peer stopped
                if isinstance(error, DivergedGathersError):
                    raise
                raise DivergedGathersError(
                    f"ZeRO stage 3: rank {self.rank} waits for its {waiting[0]} #{waiting[1]} ({waiting[2]}) and a "
                    f"peer has stopped ({error}). If the peers raised a diverging-gathers error: {_REMEDY}"
                ) from error
        self._store.set(self._key(self.rank), json.dumps({"episode": self._episode, "waiting": None}))

    def _verdict(self, previous: list[dict] | None) -> str | None:
        """A peer's published verdict, or ours when every rank is stuck in a stable state no peer can satisfy."""
        if self._store.check([self._prefix + "verdict"]):
            return bytes(self._store.get(self._prefix + "verdict")).decode()
        states = self._read_all()
        if states is None or previous is None or _episodes(states) != _episodes(previous):
            return None
        if any(_satisfiable(rank, states) for rank in range(self.world_size)):
            return None
        message = _message(states)
        self._store.set(self._prefix + "verdict", message)
        return message

    def _agree_to_stop(self, verdict: str) -> None:
        """Acknowledge the verdict and give the peers a moment to read it before raising: rank 0's process hosts
        the store, and once it is gone a peer could only say that a peer stopped."""
        acks = [f"{self._prefix}ack/{rank}" for rank in range(self.world_size)]
        deadline = time.monotonic() + 4 * POLL_S
        try:
            self._store.set(acks[self.rank], "1")
            while time.monotonic() < deadline and not self._store.check(acks):
                time.sleep(0.02)
        except RuntimeError:  # the store went away after we read the verdict: nothing more to wait for
            pass

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _read_all(self) -> list[dict] | None:
        """Every rank's published state, or None while some rank is not (or no longer) stuck."""
        keys = [self._key(rank) for rank in range(self.world_size)]
        if not self._store.check(keys):
            return None
        states = [json.loads(self._store.get(key)) for key in keys]
        return states if all(state["waiting"] is not None for state in states) else None


def _episodes(states: list[dict]) -> list[int]:
    return [state["episode"] for state in states]


def _satisfiable(rank: int, states: list[dict]) -> bool:
    """Whether every peer has posted the exchange ``rank`` waits for (so it will complete, however slowly)."""
    kind, number, what = states[rank]["waiting"]
    for peer, state in enumerate(states):
        if peer == rank:
            continue
        if state["posted"][kind] <= number:
            return False
        # gather tags carry the unit: a peer's gather with the same number but of another unit never pairs up
        if kind == "gather" and dict(map(tuple, state["history"])).get(number, what) != what:  # type: ignore[arg-type]
            return False
    return True


def _message(states: list[dict]) -> str:
    waits = "; ".join(
        f"rank {rank} waits for its {kind} #{number} ({what}) and has posted {state['posted'][kind]}"
        for rank, state in enumerate(states)
        for kind, number, what in [state["waiting"]]
    )
    gathers = [dict(map(tuple, state["history"])) for state in states]  # type: ignore[arg-type]
    first_difference = ""
    labels = {state["waiting"][2] for state in states}  # what the ranks wait for, and their first difference
    for number in sorted(set.intersection(*(set(g) for g in gathers))):
        units = [g[number] for g in gathers]
        if len(set(units)) > 1:
            labels.update(units)
            first_difference = f" Gather #{number} was " + ", ".join(
                f"{unit!r} on rank {rank}" for rank, unit in enumerate(units)) + "."
            break
    reads = sorted(label for label in labels if label.endswith(OUTSIDE_FORWARD))
    if reads:  # a parameter used outside forward on some ranks only (see [Note: parameters outside forward])
        return (
            f"ZeRO stage 3: a {reads[0]} was made on some ranks only, and through the network it is a gather every "
            f"rank must make: the ranks wait on each other forever: {waits}.{first_difference} Use the parameter "
            "on every rank (log from rank 0 only), or read it inside `with trainer.strategy.gathered_parameters():` "
            "(`engine.gathered_parameters()`) entered by every rank."
        )
    return (
        "ZeRO stage 3: the ranks gathered different units (a module called on some ranks only, e.g. experts routed "
        f"per rank) and wait on each other forever: {waits}.{first_difference} " + _REMEDY
    )


def remedy() -> str:
    """What to do about diverging gathers (part of every error of the watch)."""
    return _REMEDY


_REMEDY = (
    "With gathers through the network every rank must gather the same units in the same order: make the modules "
    'that ranks use differently one unit (e.g. ZeroConfig(unit_modules=["ModuleList"]) for the experts\' '
    "ModuleList), or run on one host's CPUs with shared-memory gathers (collectives=\"auto\" or \"shared_memory\")."
)
