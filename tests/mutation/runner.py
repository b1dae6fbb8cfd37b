"""The mutation check's test runner (started by check.py inside the scratch copy): imports the heavy libraries
once, then runs each requested pytest in a forked child, so a fault's run does not pay torch's and Lightning's
import time again (seconds per run; most of a fault's cost on a small machine).

Protocol, one JSON object per line: check.py writes ``{"args": [...], "log": path}``; the runner answers
``{"pid": pid}`` as the child starts (its own session: check.py kills it whole at the timeout) and
``{"code": exit code}`` when it ends (negative: killed by that signal). The child writes its output to ``log``.

zero_strategy itself is never imported here, only in each child: the faults are planted in it between runs.
"""

from __future__ import annotations

import json
import os
import sys


def preload() -> None:
    import lightning.pytorch  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401

    if "zero_strategy" in sys.modules:  # a planted fault would then not be seen by the tests
        raise SystemExit("mutation runner: preloading imported zero_strategy itself; a fault would be invisible")


def run_one(args: list[str], log: str) -> None:
    """In the forked child: pytest on ``args``, output to ``log``; never returns."""
    code = 3
    try:
        os.setsid()
        descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
        import pytest

        code = int(pytest.main(args))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_one(request["args"], request["log"])
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
