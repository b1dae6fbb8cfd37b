"""A forked rank starts as a fresh process would (see [Note: a forked rank starts fresh] in zero_strategy/testing.py):
launcher variables the test process picked up since it started (a fit's PL_GLOBAL_SEED) do not reach it, warnings
its parent already gave are given again in it, its parent's atexit handlers do not run in it and its own do."""

from __future__ import annotations

import atexit
import os
import warnings
from pathlib import Path

import pytest

from zero_strategy._requirements import UntestedTorchWarning, check_torch
from zero_strategy.core.once import first_time
from zero_strategy.testing import STARTING_ENVIRONMENT, run_ranks

LEAKED = {"PL_GLOBAL_SEED": "1234", "PL_SEED_WORKERS": "1", "RANK": "7", "WORLD_SIZE": "9", "NODE_RANK": "3",
          "LOCAL_RANK": "5"}


def _environment(rank: int, world: int) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in LEAKED}


@pytest.mark.timeout(60)
def test_launcher_variables_set_in_the_parent_do_not_reach_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in LEAKED.items():  # what seed_everything and a spawn fit leave in the test process
        monkeypatch.setenv(name, value)
    for seen in run_ranks(_environment, 2, timeout_s=50):
        assert seen == {name: STARTING_ENVIRONMENT.get(name) for name in LEAKED}, seen
    assert os.environ["PL_GLOBAL_SEED"] == "1234", "the parent's own environment is the test's to restore"


def _warn_at_one_place() -> None:
    warnings.warn("said at one place", UserWarning, stacklevel=1)


def _said_again(rank: int, world: int) -> dict[str, object]:
    registry = dict(globals().get("__warningregistry__", {}))
    registry.pop("version", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's once-per-location action, as outside tests
        check_torch("2.11.0")  # the library's once-per-process warning
    return {"inherited_registry": registry, "library_key_new": first_time(("fresh-ranks test", 1)),
            "untested_warnings": sum(issubclass(w.category, UntestedTorchWarning) for w in caught)}


@pytest.mark.timeout(60)
def test_a_warning_the_parent_gave_is_given_again_in_a_rank() -> None:
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("default")
        _warn_at_one_place()  # fills this module's __warningregistry__
        check_torch("2.11.0")  # the library remembers it said this
    assert any("said at one place" in str(key) for key in globals().get("__warningregistry__", {})), "premise"
    first_time(("fresh-ranks test", 1))
    assert not first_time(("fresh-ranks test", 1)), "premise: the parent has said it"
    for r in run_ranks(_said_again, 2, timeout_s=50):
        assert r["inherited_registry"] == {}, r
        assert r["library_key_new"] is True, "the library's once-per-process registry was inherited"
        assert r["untested_warnings"] == 1, r


def _register_own_handler(rank: int, world: int, folder: str) -> int:
    atexit.register(lambda: (Path(folder) / f"rank-{rank}-exit").write_text("ran"))
    return os.getpid()


@pytest.mark.timeout(60)
def test_a_rank_runs_its_own_atexit_handlers_and_not_its_parents(tmp_path: Path) -> None:
    parents = tmp_path / "parent-handler-ran"

    def parent_handler() -> None:
        parents.write_text(str(os.getpid()))

    atexit.register(parent_handler)
    try:
        pids = run_ranks(_register_own_handler, 2, str(tmp_path), timeout_s=50)
    finally:
        atexit.unregister(parent_handler)
    assert not parents.exists(), f"the parent's handler ran in a rank (pid {parents.read_text()}; ranks {pids})"
    assert sorted(p.name for p in tmp_path.glob("rank-*-exit")) == ["rank-0-exit", "rank-1-exit"]
