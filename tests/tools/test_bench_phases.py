"""The per-phase breakdown's clock: self time per label (a timed call's time minus the timed calls it made), the time
outside every timed call, and the wrapped functions given back. A fake clock makes every figure exact: no timing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.bench_report import table_rows

from benchmarks import bench_phases
from benchmarks.bench_phases import OUTSIDE, PhaseClock, breakdown_table, merge_runs


class FakeTime:
    """``perf_counter`` and ``thread_time`` that move only when the test says so (the CPU at half the wall's pace:
    the rank shares its core)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.now / 2

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Base:
    def inherited(self) -> str:
        return "base"


class Loop(Base):
    def __init__(self, clock: FakeTime) -> None:
        self.clock = clock

    def step(self) -> str:
        self.clock.advance(1.0)  # the step's own lines
        self.hook("on_batch_start")
        self.clock.advance(2.0)
        self.hook("on_batch_end")
        return self.inherited()

    def hook(self, name: str) -> None:
        self.clock.advance(0.5 if name == "on_batch_start" else 0.25)


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(bench_phases, "time", SimpleNamespace(perf_counter=fake.perf_counter,
                                                              thread_time=fake.thread_time))
    return fake


def test_self_time_per_label_adds_up_to_the_recorded_time(fake_time: FakeTime) -> None:
    clock = PhaseClock()
    clock.wrap(Loop, "step", "loop: step (own lines)")
    clock.wrap(Loop, "hook", lambda loop, name: f"hook: {name}")
    clock.wrap(Loop, "inherited", "inherited")
    try:
        loop = Loop(fake_time)
        loop.step()  # before start(): not recorded
        clock.start()
        fake_time.advance(0.125)  # outside every timed call
        assert loop.step() == "base"
        assert loop.step() == "base"
        phases = clock.stop()
    finally:
        clock.remove()

    wall = {"loop: step (own lines)": 6.0, "hook: on_batch_start": 1.0, "hook: on_batch_end": 0.5, "inherited": 0.0,
            OUTSIDE: 0.125}
    assert phases == {"wall": wall, "cpu": {label: seconds / 2 for label, seconds in wall.items()}}
    assert clock.counts["loop: step (own lines)"] == 2 and clock.counts["hook: on_batch_end"] == 2
    assert sum(phases["wall"].values()) == fake_time.now - 3.75  # everything since start(), nothing twice


def test_remove_gives_back_what_was_wrapped() -> None:
    original_step = Loop.__dict__["step"]
    clock = PhaseClock()
    clock.wrap(Loop, "step", "step")
    clock.wrap(Loop, "inherited", "inherited")  # Base's: shadowed on Loop while timed
    assert Loop.__dict__["step"] is not original_step and "inherited" in Loop.__dict__
    clock.remove()
    assert Loop.__dict__["step"] is original_step
    assert "inherited" not in Loop.__dict__ and Loop.inherited is Base.inherited


def test_breakdown_table_lists_each_phase_per_method_with_the_work_beyond_the_engine() -> None:
    # rank 0 and rank 1 of two methods, over 2 steps: the median over the ranks, per step, in ms
    trainer_wall = [{"compute: forward": 0.2, "engine: publish": 0.02, "hook: x": 0.004},
                    {"compute: forward": 0.4, "engine: publish": 0.04, "hook: x": 0.008}]
    trainer_cpu = [{label: seconds / 4 for label, seconds in rank.items()} for rank in trainer_wall]
    trainer = merge_runs([{"wall": w, "cpu": c} for w, c in zip(trainer_wall, trainer_cpu, strict=True)], steps=2)
    engine_wall = {"compute: forward": 0.2, "engine: publish": 0.02, OUTSIDE: 0.002}
    engine = merge_runs([{"wall": engine_wall, "cpu": engine_wall}] * 2, steps=2)
    assert trainer.wall == pytest.approx({"compute: forward": 150.0, "engine: publish": 15.0, "hook: x": 3.0})
    assert trainer.cpu == pytest.approx({"compute: forward": 37.5, "engine: publish": 3.75, "hook: x": 0.75})

    lines = breakdown_table({"zero1": engine, "trainer_zero1": trainer}, {"zero1": 101.0, "trainer_zero1": 101.0})
    rows = table_rows("\n".join(lines), "phase")
    assert rows["compute: forward"][1:] == ["100.00 (100.00)", "150.00 (37.50)"]
    assert rows["hook: x"][1:] == ["—", "3.00 (0.75)"]  # a phase one method does not have
    beyond = next(cells for name, cells in rows.items() if name.startswith("**beyond"))
    assert beyond[1:] == ["**1.00 (1.00)**", "**3.00 (0.75)**"]  # every phase but compute: and engine:
    total = next(cells for name, cells in rows.items() if name.startswith("**profiled"))
    assert total[1:] == ["**111.00 (111.00)**", "**168.00 (42.00)**"]
    assert breakdown_table({}, {}) == []
