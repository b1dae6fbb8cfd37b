"""Which torch imports zero_strategy (see [Note: which torch imports] in zero_strategy/_requirements.py): the
tested torch silently, another torch that has every API the code calls with one UntestedTorchWarning, a torch
lacking an API with an ImportError naming it. The APIs are found by looking at them (simulated here by replacing
them), never by the version number; a wrapped ``isend`` does not fool the check; pyproject states the tested range."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch.distributed
import torch.distributed.distributed_c10d as c10d

from zero_strategy._requirements import (
    REQUIRED_FEATURES,
    SUPPORTED_TORCH,
    TESTED_TORCH,
    TorchFeature,
    UntestedTorchWarning,
    check_torch,
    missing_features,
    parse_torch_version,
)
from zero_strategy.core.once import forget_all

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _nothing_said_yet() -> None:
    forget_all()  # the untested-torch warning is said once per process


def _said(version: str | None, features: tuple[TorchFeature, ...] = REQUIRED_FEATURES) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_torch(version, features)
    return [str(w.message) for w in caught if issubclass(w.category, UntestedTorchWarning)]


def _isend_of_torch_2_5(tensor, dst=None, group=None, tag=0):
    raise AssertionError("never called")


def test_the_torch_installed_here_has_every_api_and_is_the_tested_one() -> None:
    assert missing_features() == []
    assert _said(None) == []


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1"])
def test_the_tested_torch_imports_silently(version: str) -> None:
    assert _said(version) == []


@pytest.mark.parametrize("version", ["2.11.0+cu128", "2.14.0a0+git1234abc", "3.0.0", "unknown"])
def test_an_untested_torch_with_every_api_warns_once_naming_the_tested_version(version: str) -> None:
    said = _said(version)
    assert len(said) == 1, said
    assert f"tested with torch {TESTED_TORCH[0]}.{TESTED_TORCH[1]}, not torch {version}" in said[0]
    assert "nn.init" in said[0] and "orthogonal_" in said[0]  # what may differ: the functions recognised
    assert SUPPORTED_TORCH in said[0]
    assert _said(version) == [], "said once per process"


def test_a_missing_api_is_an_import_error_naming_it_and_the_torch_that_has_it(monkeypatch) -> None:
    monkeypatch.setattr(c10d, "isend", _isend_of_torch_2_5)  # the version number stays current: only the API is old
    with pytest.raises(ImportError) as raised:
        check_torch()
    message = str(raised.value)
    assert "torch.distributed.isend(..., group_dst=)" in message and "torch >= 2.6 has it" in message, message
    assert "irecv" not in message  # only what is missing
    assert f"pip install '{SUPPORTED_TORCH}'" in message


def test_every_feature_is_refused_when_absent() -> None:
    for feature in REQUIRED_FEATURES:
        absent = TorchFeature(feature.api, feature.since, feature.used_for, lambda: False)
        with pytest.raises(ImportError, match=f"torch >= {feature.since} has it"):
            check_torch("2.13.0", (absent,))


def test_an_old_version_number_with_every_api_is_not_refused() -> None:
    assert len(_said("2.8.0")) == 1  # warned, imported


def test_a_wrapper_is_followed_through_functools_wraps(monkeypatch) -> None:
    @functools.wraps(_isend_of_torch_2_5)
    def profiled(*args, **kwargs):
        return _isend_of_torch_2_5(*args, **kwargs)

    monkeypatch.setattr(c10d, "isend", profiled)
    assert [f.api for f in missing_features()] == ["torch.distributed.isend(..., group_dst=)"]


def test_a_bare_wrapper_of_a_current_isend_does_not_look_old(monkeypatch) -> None:
    current = c10d.isend

    def profiled(*args, **kwargs):
        return current(*args, **kwargs)

    monkeypatch.setattr(c10d, "isend", profiled)
    monkeypatch.setattr(torch.distributed, "isend", profiled)
    assert missing_features() == []


def _import_after(prelude: str) -> subprocess.CompletedProcess[str]:
    """``import zero_strategy`` in a fresh interpreter after ``prelude`` ran."""
    script = textwrap.dedent(prelude) + "\nimport zero_strategy\nprint('imported')\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_an_older_torch_version_imports_with_the_warning():
    result = _import_after("import torch\ntorch.__version__ = '2.11.0+cu128'\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("imported")
    assert result.stderr.count("UntestedTorchWarning: zero_strategy is tested with torch 2.13") == 1, result.stderr


@pytest.mark.timeout(120)
def test_a_torch_lacking_an_api_fails_at_import_naming_it():
    result = _import_after("import torch\ndel torch.nn.RMSNorm\n")
    assert result.returncode != 0
    assert "ImportError: zero_strategy cannot run on torch" in result.stderr, result.stderr[-2000:]
    assert "torch.nn.RMSNorm (for" in result.stderr and "torch >= 2.4 has it" in result.stderr


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("2.13.0+cpu", (2, 13)), ("2.14.0a0+git1234abc", (2, 14)), ("2.13.0.dev20250101", (2, 13)), ("3.0", (3, 0)),
     ("unknown", None)],
)
def test_version_strings_parse_to_major_minor(version, parsed):
    assert parse_torch_version(version) == parsed


def test_pyproject_states_the_tested_range():
    text = (REPO / "pyproject.toml").read_text()  # (tomllib is not in Python 3.10)
    dependencies = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert f'"{SUPPORTED_TORCH}"' in dependencies
    major, minor = TESTED_TORCH
    assert SUPPORTED_TORCH == f"torch>={major}.{minor},<{major}.{minor + 1}"
    assert f"torch=={major}.{minor}.0" in (REPO / "constraints.txt").read_text().splitlines()  # our install path
