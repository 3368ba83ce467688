"""(GPU) bench_draft with fused-kernel constants set first: the A/B of a knob, one process a setting.

    python benchmarks/bench_knobs.py MODULE.NAME=VALUE [...] -- BENCH_DRAFT_ARGS
    python benchmarks/bench_knobs.py fp8_linear.BATCH1_CONFIG=4,512,1,6,fma -- --weights native --cases 1x1

MODULE is a module of ``draftgraph.ops.triton`` (fp8_linear, moe_mxfp4, combiner, head, ...) and
NAME one of its constants, read by the kernels' launchers at call time (the module docstrings say
which). VALUE takes the constant's own type: an int, a bool (1 / 0 / true / false), or a GemvConfig
as block_n,block_k,num_warps,num_stages[,fma|dot]. Run the settings in processes alternated with the
default (no knob) and compare their rows: a knob never changes what a process already captured.
Bad knobs stop before any work with one line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import importlib
import runpy
import sys
from pathlib import Path

PACKAGE = "draftgraph.ops.triton"


def parse_value(text: str, current: object, what: str) -> object:
    """``text`` as a value of ``current``'s type (raises ValueError naming what was expected)."""
    from draftgraph.ops.triton.gemv import GemvConfig

    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("1", "true"):
            return True
        if lowered in ("0", "false"):
            return False
        raise ValueError(f"{what}: expected a bool (1, 0, true, false), got {text!r}")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{what}: expected an int, got {text!r}") from None
    if isinstance(current, GemvConfig):
        parts = text.split(",")
        kind = parts.pop() if parts and parts[-1] in ("fma", "dot") else "dot"
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) != 4 or min(numbers) < 1:
            raise ValueError(f"{what}: expected block_n,block_k,num_warps,num_stages[,fma|dot] (positive ints), "
                             f"got {text!r}")
        return dataclasses.replace(current, block_n=numbers[0], block_k=numbers[1], num_warps=numbers[2],
                                   num_stages=numbers[3], use_dot=kind == "dot")
    raise ValueError(f"{what}: a {type(current).__name__} is not a knob this script sets (int, bool, GemvConfig)")


def parse_knobs(items: list[str]) -> list[tuple[object, str, object]]:
    """(module, name, value) of each MODULE.NAME=VALUE; raises ValueError for the first bad one."""
    knobs = []
    for item in items:
        key, sep, text = item.partition("=")
        module_name, dot, name = key.rpartition(".")
        if not sep or not dot or not name:
            raise ValueError(f"knob {item!r}: expected MODULE.NAME=VALUE (e.g. fp8_linear.BATCH1_CONFIG=4,512,1,6,fma)")
        try:
            module = importlib.import_module(f"{PACKAGE}.{module_name}")
        except ModuleNotFoundError:
            raise ValueError(f"knob {item!r}: no module {PACKAGE}.{module_name}") from None
        if not hasattr(module, name) or name.startswith("_"):
            raise ValueError(f"knob {item!r}: {module_name} has no constant {name}")
        knobs.append((module, name, parse_value(text, getattr(module, name), key)))
    return knobs


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        raise SystemExit(2)
    sep = argv.index("--")
    try:
        knobs = parse_knobs(argv[:sep])
    except ValueError as exc:
        print(f"bench_knobs: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    for module, name, value in knobs:
        setattr(module, name, value)
        print(f"knob {module.__name__.rsplit('.', 1)[1]}.{name} = {value}", flush=True)
    run_bench_draft(argv[sep + 1:])


def run_bench_draft(args: list[str]) -> None:
    """bench_draft.py as its own script with ``args``, in this process (what was set here stays set)."""
    script = Path(__file__).resolve().parent / "bench_draft.py"  # its folder is on sys.path: it imports siblings
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
