"""benchmarks/bench_sharded.py: its --cpu-dry-run (2 gloo ranks, small shapes) and its spec-only floors.

The GPU run (torchrun, NCCL, V4-Flash shapes) has never run; these check that the script's
structure holds: every rank builds its shard, proposes, times the collectives alone and
reports its floor from its own weights' specs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> str:
    done = subprocess.run([sys.executable, "benchmarks/bench_sharded.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_cpu_dry_run_prints_a_row_per_case():
    rows = [line.split() for line in _run("--cpu-dry-run", "--cases", "1x1,2x3").splitlines()
            if re.match(r"\s*2\s+\d+\s+\d+\s", line)]
    assert [(r[1], r[2]) for r in rows] == [("1", "1"), ("2", "3")]
    for r in rows:
        floor_mb, replay_ms, comm_us = float(r[3]), float(r[5]), float(r[7])
        assert floor_mb > 0 and replay_ms > 0 and comm_us > 0


def test_per_rank_floor_halves_the_head_and_the_experts():
    lines = {m.group(1, 2): float(m.group(3)) for m in
             re.finditer(r"B=(\d+)\s+W=(\d)\s*:\s+([\d.]+)", _run("--floors"))}
    assert lines[("1", "1")] > lines[("1", "2")] > lines[("1", "4")] > lines[("1", "8")]
    # what stays (attention, e_proj/h_proj, mHC, gate) is replicated: W=8 keeps more than an eighth
    assert lines[("1", "8")] > lines[("1", "1")] / 8
