"""draftgraph plan-csv: plan one MiniMalloc CSV instance and report how close it came to the bound.

Reads ``id,lower,upper,size`` rows (live over [lower, upper)), plans them at alignment 1 and
prints the number of buffers, the lower bound (max live bytes at any step), the planned arena,
their ratio, whether it fits the capacity, and the planning time. Exit code 0 when the plan
fits (or no capacity is known), 1 when it does not fit, 2 on bad input: one line on stderr
(a file without buffer rows, a field that is not an integer or is 2**62 or more, sizes adding up
to 2**62 or more, a time limit that is not a finite number > 0, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

EXAMPLES = """examples:
  draftgraph plan-csv benchmarks/planner/A.1048576.csv              # capacity 1048576 from the name
  draftgraph plan-csv benchmarks/planner/unit/tflm_greedy_medium.csv --capacity 80
  draftgraph plan-csv benchmarks/planner/C.1048576.csv --time-limit 9 --json > plan.json
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan-csv`` on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "plan-csv",
        help="plan a MiniMalloc CSV instance and compare with its lower bound",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", type=Path, help="MiniMalloc CSV: id,lower,upper,size per row")
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="bytes the plan must fit in (default: from a name like A.1048576.csv, else none)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, with every offset")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=1.0,
        help="seconds the improving search may use (finite, > 0; default 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Plan ``args.file``; print a report (or JSON); return the exit code."""
    from draftgraph.runtime.errors import DraftGraphError, describe
    from draftgraph.runtime.planning.arena_plan import plan_arena
    from draftgraph.runtime.planning.minimalloc_csv import capacity_from_name, load_minimalloc_csv

    capacity = getattr(args, "capacity", None)
    time_limit_s = getattr(args, "time_limit", 1.0)
    try:
        if capacity is not None and capacity < 0:
            raise ValueError(f"--capacity: expected bytes >= 0, got {capacity}")
        if not (math.isfinite(time_limit_s) and time_limit_s > 0):
            raise ValueError(describe("--time-limit", "a finite number of seconds > 0", time_limit_s))
        buffers = load_minimalloc_csv(args.file)
    except FileNotFoundError:
        return _fail(describe("file", "a MiniMalloc CSV file", f"{str(args.file)!r} (no such file)"))
    except OSError as err:  # a folder, no permission, a name the system cannot look up
        return _fail(describe("file", "a readable MiniMalloc CSV file", f"{str(args.file)!r} ({err.strerror or err})"))
    except (DraftGraphError, ValueError) as err:
        return _fail(str(err).splitlines()[0])

    plan = plan_arena(buffers, alignment=1, time_limit_s=time_limit_s, seed=getattr(args, "seed", 0))
    if capacity is None:
        capacity = capacity_from_name(args.file)
    fits = None if capacity is None else plan.arena_bytes <= capacity
    ratio = plan.arena_bytes / plan.lower_bound if plan.lower_bound else 1.0
    if getattr(args, "json", False):
        report = {
            "file": str(args.file),
            "num_buffers": len(buffers),
            "lower_bound": plan.lower_bound,
            "arena_bytes": plan.arena_bytes,
            "ratio": round(ratio, 6),
            "capacity": capacity,
            "fits": fits,
            "strategy": plan.strategy,
            "planning_seconds": round(plan.planning_seconds, 4),
            "offsets": plan.offsets,
        }
        print(json.dumps(report))
    else:
        print(f"file         {args.file}")
        print(f"buffers      {len(buffers)}")
        print(f"lower bound  {plan.lower_bound}")
        print(f"planned      {plan.arena_bytes}  ({ratio:.4f} x the bound, {plan.strategy})")
        if capacity is None:
            print("capacity     none given")
        elif fits:
            print(f"capacity     {capacity}: fits ({capacity - plan.arena_bytes} to spare)")
        else:
            print(f"capacity     {capacity}: does NOT fit ({plan.arena_bytes - capacity} over)")
        print(f"time         {plan.planning_seconds:.2f} s")
    return 1 if fits is False else 0


def _fail(message: str) -> int:
    print(f"draftgraph plan-csv: error: {message}", file=sys.stderr)
    return 2
