"""The supported torch range: a torch that is too old fails at import with a message naming the need, the check
reads the version number (a wrapped ``isend`` does not fool it), and pyproject states the same range."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zero_strategy._requirements import MIN_TORCH, SUPPORTED_TORCH, check_torch, parse_torch_version

REPO = Path(__file__).resolve().parents[2]


def _import_after(prelude: str) -> subprocess.CompletedProcess[str]:
    """``import zero_strategy`` in a fresh interpreter after ``prelude`` ran."""
    script = textwrap.dedent(prelude) + "\nimport zero_strategy\nprint('imported')\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_old_torch_fails_at_import_naming_the_version_needed():
    result = _import_after("import torch\ntorch.__version__ = '2.12.1+cpu'\n")
    assert result.returncode != 0
    assert "ImportError: zero_strategy needs torch >= 2.13, found torch 2.12.1+cpu" in result.stderr, result.stderr
    assert "pip install 'torch>=2.13,<2.14'" in result.stderr


@pytest.mark.timeout(120)
def test_a_wrapped_isend_does_not_make_a_current_torch_look_old():
    # what a profiler or logger does: wrap torch.distributed.isend without functools.wraps
    result = _import_after(
        """
        import torch.distributed as dist

        original = dist.isend

        def isend(*args, **kwargs):
            return original(*args, **kwargs)

        dist.isend = isend
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("imported")


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("2.13.0+cpu", (2, 13)), ("2.14.0a0+git1234abc", (2, 14)), ("2.13.0.dev20250101", (2, 13)), ("3.0", (3, 0))],
)
def test_version_strings_parse_to_major_minor(version, parsed):
    assert parse_torch_version(version) == parsed


@pytest.mark.parametrize("version", ["2.6.0", "2.12.1", "1.13.1+cu117"])
def test_versions_below_the_floor_are_refused(version):
    with pytest.raises(ImportError, match=re.escape(f"found torch {version}")):
        check_torch(version)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.1"])
def test_versions_at_or_above_the_floor_pass(version):
    check_torch(version)


def test_an_unreadable_version_is_a_clear_error():
    with pytest.raises(ImportError, match="cannot read torch's version 'unknown'"):
        check_torch("unknown")


def test_current_torch_passes_the_check():
    check_torch()


def test_pyproject_and_the_import_check_state_the_same_torch_range():
    text = (REPO / "pyproject.toml").read_text()  # (tomllib is not in Python 3.10)
    dependencies = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert f'"{SUPPORTED_TORCH}"' in dependencies
    assert SUPPORTED_TORCH.startswith(f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]},")
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().splitlines()  # our own install path
