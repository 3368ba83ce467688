"""benchmarks/bench_loop_host.py: the gap a step is measured from a read-back to the next launch,
and a short run on the tiny model prints a row per batch and loop."""

from __future__ import annotations

import bench_loop_host
from bench_loop_host import Clock


def test_gaps_run_from_each_read_to_the_next_launch():
    clock = Clock()
    for what, at in [("launch", 0.0), ("read", 1.0), ("launch", 1.5), ("launch", 1.7), ("read", 3.0),
                     ("read", 4.0), ("launch", 4.25)]:
        clock.events.append((what, at))
    assert clock.gaps("read") == [0.5, 0.25]  # a read with no launch after it before the next read: none


def test_a_short_run_prints_every_row(capsys):
    assert bench_loop_host.main(["--batches", "1,2", "--steps", "12", "--repeat", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [r[:2] for r in rows[1:]] == [["1", "spec"], ["1", "greedy"], ["2", "spec"], ["2", "greedy"]]
    for row in rows[1:]:
        gap, host, steps = float(row[2]), float(row[3]), int(row[4])
        assert 0 < gap <= host * 1.5 and steps >= 11, row  # the gap is part of a step's host work
