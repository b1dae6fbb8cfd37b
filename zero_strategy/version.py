"""The library's version, read from the installed distribution's metadata so that pyproject.toml is its only
source (a checkpoint's manifest records it)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "zero_strategy"
UNKNOWN = "0+unknown"
"""A PEP 440 local version that sorts below every release: the package runs from a source tree never installed."""


def library_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN
