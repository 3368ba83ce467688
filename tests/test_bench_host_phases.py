"""benchmarks/bench_host.py: splitting one propose's timestamps into phases."""

from __future__ import annotations

import pytest
from bench_host import PhaseClock


def clock_with(marks: list[tuple[str, float]]) -> PhaseClock:
    clock = PhaseClock.__new__(PhaseClock)  # the marks alone: no proposer to wrap
    clock.marks = list(marks)
    return clock


def test_phases_split_a_propose_at_its_marks():
    clock = clock_with([("propose<", 0.0), ("pass<", 1.0), ("pass>", 2.5), ("ensure<", 3.0), ("ensure>", 3.5),
                        ("ensure<", 4.0), ("ensure>", 5.0), ("stage<", 6.0), ("stage>", 9.0), ("run<", 9.5),
                        ("run>", 12.0), ("propose>", 20.0)])
    assert clock.phases() == pytest.approx(
        {"pass": 1.5, "ensure": 1.5, "rows": 0.0, "other": 3.0, "stage": 3.0, "run": 2.5, "after": 8.0})
    assert clock.marks == []


def test_a_propose_without_pass_or_ensure_counts_all_before_the_stage_as_other():
    clock = clock_with([("propose<", 0.0), ("stage<", 6.0), ("stage>", 9.0), ("run<", 9.5), ("run>", 12.0),
                        ("propose>", 20.0)])
    assert clock.phases() == pytest.approx(
        {"pass": 0.0, "ensure": 0.0, "rows": 0.0, "other": 6.0, "stage": 3.0, "run": 2.5, "after": 8.0})


def test_the_general_paths_rows_are_their_own_phase():
    clock = clock_with([("propose<", 0.0), ("pass<", 0.5), ("pass>", 1.0), ("ensure<", 2.0), ("ensure>", 3.0),
                        ("rows<", 3.2), ("rows>", 5.2), ("stage<", 6.0), ("stage>", 9.0), ("run<", 9.5), ("run>", 12.0),
                        ("propose>", 20.0)])
    assert clock.phases() == pytest.approx(
        {"pass": 0.5, "ensure": 1.0, "rows": 2.0, "other": 2.5, "stage": 3.0, "run": 2.5, "after": 8.0})
