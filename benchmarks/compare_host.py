"""Issue 26's table: the caller's wait before and after, from bench_draft runs of two trees in one session.

    python benchmarks/compare_host.py --before OUT/before OUT/before_2 --after OUT/draft OUT/draft_2
                                      [--weights bf16]

Each argument is a folder (or file) holding a ``bench_draft_*.json``; ``--before`` the runs of the
older tree (its own bench_draft, run from its folder), ``--after`` this tree's. The lent hosts have
slow spells of seconds in which every host phase of a case doubles, and one bench_draft run times a
case in well under a second: so a run caught in a spell compares nothing (the thirty-fifth
session's, benchmarks/h200/README.md). ``device_run_h200.sh`` therefore alternates the two trees'
runs (``RUN=2``, ...), and this prints, for each case and tree, every run's captured row and the
best one: the run with the lowest host time before the launch, the same rule for both trees. The
columns are what the issue asks for: replay ms (the GPU alone), propose ms (what a decode loop's
caller waits a round, by the run's own method), propose - replay in µs, host µs before the launch,
and the issue's targets (host <= 25 / 40 µs and propose - replay <= 50 / 80 µs at B = 1 / 32).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Issue 26, point 2: (host us before the launch, propose - replay us) at most, by batch.
TARGETS = {1: (25.0, 50.0), 32: (40.0, 80.0)}
CAPTURED = "draftgraph captured, fused ops"


def load_rows(path: Path, weights: str) -> list[dict]:
    """The captured fused rows of one run (a bench_draft JSON, or the folder holding one) in ``weights``.

    A tree older than ``ProposerOptions.weights`` wrote no ``weights`` key: its rows are bf16."""
    files = sorted(path.glob("bench_draft_*.json")) if path.is_dir() else [path]
    if len(files) != 1:
        raise SystemExit(f"error: {path}: expected one bench_draft_*.json, found {len(files)}")
    saved = json.loads(files[0].read_text())
    return [row for row in saved["rows"] if row["variant"] == CAPTURED and row.get("weights", "bf16") == weights]


def best_rows(runs: list[list[dict]]) -> dict[tuple[int, int], tuple[dict, list[dict]]]:
    """Per case (B, K): the row of the run with the lowest host µs, and every run's row."""
    cases: dict[tuple[int, int], list[dict]] = {}
    for rows in runs:
        for row in rows:
            cases.setdefault((row["batch"], row["k"]), []).append(row)
    return {case: (min(rows, key=lambda r: r["host_us"]), rows) for case, rows in sorted(cases.items())}


def wait_us(row: dict) -> float:
    return (row["propose_ms"] - row["replay_ms"]) * 1e3


def verdict(batch: int, row: dict) -> str:
    if batch not in TARGETS:
        return ""
    host, wait = TARGETS[batch]
    return (f"host {'meets' if row['host_us'] <= host else 'misses'} {host:.0f}, "
            f"wait {'meets' if wait_us(row) <= wait else 'misses'} {wait:.0f}")


def table(before: list[list[dict]], after: list[list[dict]]) -> list[str]:
    lines = ["  B  K  tree    runs  replay ms  propose ms  propose-replay us  host us  (every run's host us)  target"]
    for name, runs in (("before", before), ("after", after)):
        for (batch, k), (row, rows) in best_rows(runs).items():
            every = " ".join(f"{r['host_us']:.0f}" for r in rows)
            target = verdict(batch, row) if name == "after" else ""
            lines.append(f"{batch:3d} {k:2d}  {name:6s} {len(rows):5d} {row['replay_ms']:10.3f} "
                         f"{row['propose_ms']:11.3f} {wait_us(row):18.0f} {row['host_us']:8.0f}  ({every})  {target}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", nargs="+", type=Path, required=True, help="the older tree's runs")
    ap.add_argument("--after", nargs="+", type=Path, required=True, help="this tree's runs")
    ap.add_argument("--weights", default="bf16", help="the rows' weight format (the older tree had bf16 only)")
    args = ap.parse_args(argv)
    before = [load_rows(p, args.weights) for p in args.before]
    after = [load_rows(p, args.weights) for p in args.after]
    print(f"captured fused rows, {args.weights} weights; best = the run with the lowest host us, for both trees")
    print("\n".join(table(before, after)))


if __name__ == "__main__":
    main()
