"""The mutation check's own mechanism (tests/mutation/check.py): a stale fault is an error, and a run counts as a
kill only when a test failed. Also holds the fault table to the code as it is now, so that moving code a fault
points at fails here, in the ordinary suite, and not only in `make mutation-check`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from mutation.check import REPO_ROOT, Run, StaleFault, judge, plant, table_problems
from mutation.faults import FAULTS, Fault

FAULT = Fault(name="f", area="comm", file="zero_strategy/x.py", original="a + b", replacement="a - b",
              description="a sign", tests=("tests/unit/test_layout.py",))


def test_a_fault_is_planted_exactly_where_its_snippet_is() -> None:
    assert plant(FAULT, "x = a + b\ny = 1\n") == "x = a - b\ny = 1\n"


@pytest.mark.parametrize(("text", "count"), [("x = a * b\n", 0), ("x = a + b\ny = a + b\n", 2)])
def test_a_snippet_found_zero_or_two_times_is_an_error_naming_the_fault(text: str, count: int) -> None:
    with pytest.raises(StaleFault, match=rf"fault 'f': its original snippet occurs {count} times in zero_strategy/x"):
        plant(FAULT, text)


def test_the_table_matches_the_code_as_it_is() -> None:
    assert table_problems(FAULTS, REPO_ROOT) == []
    assert len(FAULTS) >= 15


def test_table_problems_name_every_stale_fault(tmp_path: Path) -> None:
    (tmp_path / "zero_strategy").mkdir()
    (tmp_path / "zero_strategy" / "x.py").write_text("x = a * b\n")
    moved = dataclasses.replace(FAULT, name="moved", file="zero_strategy/gone.py")
    no_test = dataclasses.replace(FAULT, name="no-test", tests=("tests/unit/test_gone.py::test_x",))
    problems = table_problems([FAULT, moved, no_test, FAULT], tmp_path)
    assert "fault name 'f' is used twice" in problems
    assert any("'moved': zero_strategy/gone.py does not exist" in p for p in problems)
    assert any("'f': its original snippet occurs 0 times" in p for p in problems)
    assert any("'no-test': test file tests/unit/test_gone.py does not exist" in p for p in problems)


@pytest.mark.parametrize(
    ("returncode", "output", "killed", "detail"),
    [
        (1, "F\nFAILED tests/a.py::test_x[1] - AssertionError: no\n", True, "tests/a.py::test_x[1]"),
        (1, "E\nERROR tests/a.py::test_y - RuntimeError\n", True, "tests/a.py::test_y (fixture)"),
        (0, "1 passed\n", False, "SURVIVED"),
        (2, "ERROR collecting tests/a.py\n", False, "ERROR: pytest exit 2"),
        (5, "no tests ran\n", False, "ERROR: pytest exit 5"),
        (None, "", False, "TIMEOUT"),
    ],
)
def test_only_a_failing_test_kills(returncode: int | None, output: str, killed: bool, detail: str) -> None:
    verdict = judge(FAULT, Run(returncode, 1.0, output))
    assert verdict.killed is killed
    assert verdict.detail.startswith(detail)
