"""The mutation check: plant each fault of faults.py, one at a time, in a scratch copy of the repository, run the
tests that should catch it, and fail unless every fault is caught.

    python -m tests.mutation.check             # every fault (make mutation-check)
    python -m tests.mutation.check --only NAME # one fault (repeatable), e.g. while writing the test that kills it
    python -m tests.mutation.check --list      # the fault table, nothing run

[Note: how the mutation check stays honest]
- The working tree is never written: the files git knows (tracked, and untracked ones not ignored) are copied into a
  temporary directory, the faults are planted there, and the tests run there with that copy first on PYTHONPATH
  (the venv's editable install points at the main checkout; forked, spawned and popen-launched ranks inherit the
  environment). The copy is deleted on every exit, Ctrl-C included, and the test processes' whole session with it.
- A fault names the exact text it replaces. Text found zero times or more than once is an error before anything
  runs: code that moved or changed makes a stale fault, and a stale fault must not pass as "survived" or be skipped.
- Before any fault, the union of the tests runs once on the unplanted copy and must pass, and the copy must be
  the package Python imports: otherwise a "kill" proves nothing.
- A fault is killed when one of its tests fails (pytest exit code 1). A collection error (the fault broke an
  import), a run that outlives its timeout and a run that passes all fail the check.
- Each run is a pytest in a child forked from one runner (runner.py) that imported torch and Lightning once but
  never zero_strategy (it refuses to start if they pulled it in): every child imports the library afresh, fault
  included. Each planted file gets a modification time of its own, so no process reuses a bytecode cache compiled
  from another version of it (a cache is keyed by the source's size and whole-second mtime).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .faults import FAULTS, Fault

REPO_ROOT = Path(__file__).resolve().parents[2]
FAULT_TIMEOUT_S = 300.0  # one fault's pytest run; each test has its own shorter pytest-timeout inside it
STARTUP_TIMEOUT_S = 120.0  # the runner's imports; a run's start and the report of a killed run
# `make test`'s rule (see [Note: which rank deaths are retried] in tests/conftest.py): a rank that died at exit
# after finishing its work is not a failure a fault caused
PYTEST_ARGS = ("-q", "-p", "no:cacheprovider", "-o", "addopts=-ra", "--reruns", "1",
               "--only-rerun", "RankExitedAfterFinishing")


class StaleFault(ValueError):
    """A fault whose snippet is not in its file exactly once: the code moved or changed; update faults.py."""


def plant(fault: Fault, text: str) -> str:
    """``text`` (the content of ``fault.file``) with the fault planted; raises :class:`StaleFault` unless the
    fault's original snippet occurs exactly once."""
    count = text.count(fault.original)
    if count != 1:
        raise StaleFault(
            f"fault {fault.name!r}: its original snippet occurs {count} times in {fault.file} (it must occur exactly "
            "once); the code moved or changed: update tests/mutation/faults.py"
        )
    return text.replace(fault.original, fault.replacement)


def table_problems(faults: Sequence[Fault], root: Path) -> list[str]:
    """Everything wrong with the fault table against the tree at ``root``, all at once."""
    problems: list[str] = []
    names = [fault.name for fault in faults]
    problems += [f"fault name {name!r} is used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    for fault in faults:
        path = root / fault.file
        if not path.is_file():
            problems.append(f"fault {fault.name!r}: {fault.file} does not exist (moved?): update faults.py")
            continue
        try:
            plant(fault, path.read_text())
        except StaleFault as error:
            problems.append(str(error))
        if fault.original == fault.replacement:
            problems.append(f"fault {fault.name!r}: its replacement equals its original")
        if not fault.tests:
            problems.append(f"fault {fault.name!r} names no test to kill it")
        for node in fault.tests:
            test_file = node.split("::", 1)[0]
            if not (root / test_file).is_file():
                problems.append(f"fault {fault.name!r}: test file {test_file} does not exist")
    return problems


# ------------------------------------------------------------------------------------------- the scratch copy
def copy_tree(source: Path, target: Path) -> None:
    """The files git knows in ``source`` (tracked, and untracked but not ignored), as they are now, into ``target``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=source,
                            check=True, capture_output=True).stdout.decode()
    for relative in filter(None, listed.split("\0")):
        origin = source / relative
        if not origin.is_file():  # a tracked file deleted in the working tree
            continue
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, destination)


@dataclass(frozen=True, slots=True)
class Run:
    """One pytest run in the copy."""

    returncode: int | None  # None: killed at the timeout
    seconds: float
    output: str

    def failed_tests(self) -> list[str]:
        """Node ids pytest's summary reports as FAILED, then those it reports as ERROR (failures in fixtures)."""
        failed: list[str] = []
        errors: list[str] = []
        for line in self.output.splitlines():
            for word, into in (("FAILED ", failed), ("ERROR ", errors)):
                if line.startswith(word):
                    into.append(line[len(word):].split(" - ", 1)[0].strip())
        return failed + [f"{node} (fixture)" for node in errors]


class Runner:
    """runner.py inside the copy: one interpreter that imported torch and Lightning once and forks a pytest per run
    (see runner.py). Each run's child has a session of its own, killed whole (ranks included) at the timeout, on
    Ctrl-C, and after it ends (ranks it left behind)."""

    def __init__(self, copy: Path) -> None:
        self.copy = copy
        self.runs = 0
        self.child: int | None = None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.mutation.runner"], cwd=copy, env=environment(copy),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        self._replies: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read_replies, daemon=True).start()
        self._reply(STARTUP_TIMEOUT_S)

    def _read_replies(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._replies.put(json.loads(line))
        self._replies.put({"ended": True})

    def _reply(self, timeout_s: float) -> dict:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError from None
        if "ended" in reply:
            raise RuntimeError(f"the mutation runner ended unexpectedly (exit {self.process.wait()})")
        return reply

    def run(self, node_ids: Iterable[str], stop_at_first: bool, timeout_s: float) -> Run:
        """pytest on ``node_ids`` in the copy; killed at ``timeout_s``."""
        self.runs += 1
        log = self.copy.parent / f"run-{self.runs}.log"
        args = [*PYTEST_ARGS, *(["-x"] if stop_at_first else []), *node_ids]
        start = time.monotonic()
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"args": args, "log": str(log)}) + "\n")
        self.process.stdin.flush()
        self.child = int(self._reply(STARTUP_TIMEOUT_S)["pid"])
        returncode: int | None
        try:
            returncode = int(self._reply(max(1.0, timeout_s - (time.monotonic() - start)))["code"])
        except TimeoutError:
            _kill_session(self.child)
            self._reply(STARTUP_TIMEOUT_S)  # the runner reports the killed child
            returncode = None
        finally:
            _kill_session(self.child)
            self.child = None
        return Run(returncode, time.monotonic() - start, log.read_text(errors="replace"))

    def close(self) -> None:
        if self.child is not None:
            _kill_session(self.child)
        _kill_session(self.process.pid)
        self.process.wait()


def _kill_session(leader: int) -> None:
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:  # the session is gone already
        pass


def environment(copy: Path) -> dict[str, str]:
    """This process's environment with the copy first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])]))


def imported_package(copy: Path) -> str:
    """Where ``zero_strategy`` is found with the copy on PYTHONPATH (found, not imported: that takes seconds)."""
    return subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('zero_strategy').origin)"],
        cwd=copy, env=environment(copy), check=True, capture_output=True, text=True,
    ).stdout.strip()


# ---------------------------------------------------------------------------------------------- one fault
@dataclass(frozen=True, slots=True)
class Verdict:
    fault: Fault
    killed: bool
    detail: str  # the killing test, or why the fault counts as not caught
    seconds: float


def judge(fault: Fault, run: Run) -> Verdict:
    if run.returncode is None:
        return Verdict(fault, False, f"TIMEOUT after {run.seconds:.0f} s (a hang no test's own timeout caught)",
                       run.seconds)
    if run.returncode == 0:
        return Verdict(fault, False, "SURVIVED", run.seconds)
    failed = run.failed_tests()
    if run.returncode == 1 and failed:
        return Verdict(fault, True, failed[0], run.seconds)
    why = {2: "interrupted (collection error: did the fault break an import?)", 5: "no tests collected"}
    return Verdict(fault, False, f"ERROR: pytest exit {run.returncode}, "
                                 f"{why.get(run.returncode, 'internal or usage error')}", run.seconds)


def try_fault(fault: Fault, runner: Runner, index: int, timeout_s: float, show_output: bool = False) -> Verdict:
    """Plant ``fault`` in the runner's copy, run its tests, put the file back (checked)."""
    path = runner.copy / fault.file
    original = path.read_bytes()
    stat = path.stat()
    try:
        path.write_text(plant(fault, original.decode()))
        # a modification time no other version of this file has (see the Note)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + (index + 1) * 1_000_000_000))
        run = runner.run(fault.tests, stop_at_first=True, timeout_s=timeout_s)
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    if path.read_bytes() != original:
        raise RuntimeError(f"{path} was not restored after fault {fault.name!r}")
    verdict = judge(fault, run)
    if show_output or not verdict.killed:
        print(run.output[-4000:], file=sys.stderr)
    return verdict


# ------------------------------------------------------------------------------------------------- report
def print_table(verdicts: Sequence[Verdict]) -> None:
    name_width = max(len(v.fault.name) for v in verdicts)
    area_width = max(len(v.fault.area) for v in verdicts)
    print(f"\n{'fault':<{name_width}}  {'area':<{area_width}}  {'time':>6}  killed by")
    for v in verdicts:
        print(f"{v.fault.name:<{name_width}}  {v.fault.area:<{area_width}}  {v.seconds:5.1f}s  {v.detail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation.check", description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this fault (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the faults and their tests, run nothing")
    parser.add_argument("--timeout", type=float, default=FAULT_TIMEOUT_S, help="seconds per fault's test run")
    parser.add_argument("--show-output", action="store_true", help="print the end of every fault's test output")
    args = parser.parse_args(argv)

    problems = table_problems(FAULTS, REPO_ROOT)
    if problems:
        print("mutation check: the fault table does not match the code:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    faults = list(FAULTS)
    if args.only:
        unknown = sorted(set(args.only) - {fault.name for fault in faults})
        if unknown:
            print(f"mutation check: no fault named {', '.join(unknown)} (see --list)", file=sys.stderr)
            return 2
        faults = [fault for fault in faults if fault.name in args.only]
    if args.list:
        for fault in faults:
            print(f"{fault.name} [{fault.area}] {fault.file}: {fault.description}\n    " + "\n    ".join(fault.tests))
        return 0

    # a CI job cancelled sends SIGTERM: leave through the same clean-up as Ctrl-C (the copy deleted, runs killed)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zero-mutation-") as scratch:
        copy = Path(scratch) / "repo"
        copy_tree(REPO_ROOT, copy)
        found = imported_package(copy)
        if not found.startswith(str(copy)):
            print(f"mutation check: the tests would import zero_strategy from {found}, not the copy", file=sys.stderr)
            return 2
        runner = Runner(copy)
        try:
            union = list(dict.fromkeys(node for fault in faults for node in fault.tests))
            print(f"baseline: {len(union)} test selections of {len(faults)} faults on the unplanted copy ...",
                  flush=True)
            baseline = runner.run(union, stop_at_first=False, timeout_s=args.timeout * 2)
            if baseline.returncode != 0:
                print(baseline.output[-6000:], file=sys.stderr)
                print(f"mutation check: the tests fail without any fault (pytest exit {baseline.returncode}), so a "
                      "kill would prove nothing; fix them first", file=sys.stderr)
                return 2
            print(f"baseline passed in {baseline.seconds:.1f} s", flush=True)
            verdicts = []
            for index, fault in enumerate(faults):
                verdict = try_fault(fault, runner, index, args.timeout, args.show_output)
                print(f"  {fault.name}: {verdict.detail} ({verdict.seconds:.1f} s)", flush=True)
                verdicts.append(verdict)
        finally:
            runner.close()
    print_table(verdicts)
    alive = [v for v in verdicts if not v.killed]
    total = time.monotonic() - started
    print(f"\n{len(verdicts) - len(alive)} of {len(verdicts)} faults killed; baseline {baseline.seconds:.1f} s, "
          f"total {total:.1f} s")
    if alive:
        print(f"mutation check FAILED: not caught: {', '.join(v.fault.name for v in alive)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
