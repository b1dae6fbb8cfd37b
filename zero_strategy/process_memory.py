"""This process's resident memory as Linux reports it in /proc/self: the current resident set and its peak since
the last reset. The memory tests and benchmarks measure with it: what the kernel counted, whoever allocated it,
not what the code under test reports about itself. Linux only (other systems have no /proc/self/status)."""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(field: str) -> int:
    """One memory line of /proc/self/status in bytes: "VmRSS" (resident now), "VmHWM" (the peak since the last
    :func:`reset_peak`), "RssAnon", ..."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise KeyError(f"{field} is not a line of {_STATUS}")


def reset_peak() -> int:
    """Make the peak (``VmHWM``) start again from the current resident set; return that resident set in bytes, the
    baseline a later ``status_bytes("VmHWM")`` is read against."""
    _CLEAR_REFS.write_text("5")
    return status_bytes("VmRSS")
