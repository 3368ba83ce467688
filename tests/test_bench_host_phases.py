"""benchmarks/bench_host.py: splitting one propose's timestamps into phases."""

from __future__ import annotations

import pytest
from bench_host import PHASES, PhaseClock


def clock_with(marks: list[tuple[str, float]]) -> PhaseClock:
    clock = PhaseClock.__new__(PhaseClock)  # the marks alone: no proposer to wrap
    clock.marks = list(marks)
    return clock


def test_phases_split_a_propose_at_its_marks():
    clock = clock_with([("propose<", 0.0), ("stage<", 4.0), ("stage>", 9.0), ("run<", 9.5), ("run>", 12.0),
                        ("read<", 12.5), ("read>", 18.0), ("propose>", 20.0)])
    phases = clock.phases()
    assert phases == pytest.approx({"checks": 4.0, "stage": 5.0, "run": 3.0, "wait": 6.0, "commit": 2.0})
    assert tuple(phases) == PHASES and clock.marks == []


def test_a_second_read_after_the_drafts_is_commit_time():
    """With confidences asked for, the probs' read-back comes after the drafts': it is commit time."""
    clock = clock_with([("propose<", 0.0), ("stage<", 2.0), ("stage>", 3.0),
                        ("run<", 3.0), ("run>", 4.0), ("read<", 4.0), ("read>", 9.0), ("read<", 10.0),
                        ("read>", 12.0), ("propose>", 13.0)])
    assert clock.phases()["commit"] == pytest.approx(4.0)
