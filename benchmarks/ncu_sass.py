"""Where a kernel's warps wait, instruction by instruction: a summary of ncu's SASS source page.

    ncu --section SourceCounters ... -o REPORT python3 ...        # on the GPU (device_run_ncu_moe.sh)
    ncu --import REPORT.ncu-rep --page source --print-source sass --csv > SASS.csv
    python benchmarks/ncu_sass.py SASS.csv[.gz] [--top 25]

For each kernel in the CSV (one block a profiled launch, as ncu prints them): the warp-stall
samples by reason over the whole kernel, the instructions that hold the most samples (each with
its two largest reasons), and the executed instructions by opcode. ncu samples each warp's
program counter at a fixed interval and records why it was not issuing, so a kernel's samples
split by reason say what its warps wait on (``stall_long_sb``: a global or local load's result;
``stall_wait``: a fixed-latency dependency; ``stall_math``: a busy pipe; ``stall_selected``:
issuing), and the instructions that hold them say where. docs/KERNELS.md ("What is left") names
the kernels this is for: the MXFP4 MoE's tensor-core kernels and the FP8 dot tiles at B > 1.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


class Kernel(NamedTuple):
    name: str
    rows: list[dict[str, str]]


def read_kernels(text: str) -> list[Kernel]:
    """The CSV's blocks: a ``"Kernel Name","NAME"`` line, a header, then a row an instruction."""
    kernels: list[Kernel] = []
    header: list[str] | None = None
    for record in csv.reader(io.StringIO(text)):
        if not record:
            continue
        if record[0] == "Kernel Name":
            kernels.append(Kernel(record[1], []))
            header = None
        elif header is None:
            header = record
        elif kernels:
            kernels[-1].rows.append(dict(zip(header, record)))
    if not kernels:
        raise ValueError('expected ncu --page source --csv output (a "Kernel Name" line first), found none')
    return kernels


def _number(value: str) -> float:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return 0.0  # ncu writes "-" where a metric does not apply


def opcode(source: str) -> str:
    """The SASS opcode of an instruction line (its predicate dropped): ``@!P0 LDG.E.128 R4, [R2]`` -> ``LDG.E.128``."""
    words = source.split()
    if words and re.fullmatch(r"@!?U?P[T0-9]+", words[0]):
        words = words[1:]
    return words[0].rstrip(";") if words else "?"


def summary(kernel: Kernel, top: int = 25) -> list[str]:
    rows = kernel.rows
    reasons = [key for key in rows[0] if key.startswith("stall_") and not key.endswith("(Not Issued)")] if rows else []
    total = sum(_number(r.get(SAMPLES, "0")) for r in rows)
    executed = sum(_number(r.get(EXECUTED, "0")) for r in rows)
    lines = [f"kernel {kernel.name}: {len(rows)} SASS instructions, {total:.0f} stall samples, "
             f"{executed:.0f} warp-instructions executed"]
    if not total:
        return lines + ["  no samples (was --section SourceCounters collected?)"]
    by_reason = Counter({reason: sum(_number(r[reason]) for r in rows) for reason in reasons})
    lines.append("  samples by reason:")
    lines += [f"    {reason:<24} {n:8.0f} {n / total:6.1%}" for reason, n in by_reason.most_common() if n]
    lines.append(f"  the {top} instructions holding the most samples (address, samples, share, "
                 "the two largest reasons):")
    hottest = sorted(rows, key=lambda r: -_number(r.get(SAMPLES, "0")))[:top]
    for r in hottest:
        n = _number(r[SAMPLES])
        if not n:
            break
        two = sorted(reasons, key=lambda reason: -_number(r[reason]))[:2]
        why = ", ".join(f"{reason[6:]} {_number(r[reason]):.0f}" for reason in two if _number(r[reason]))
        lines.append(f"    {r['Address'][-5:]:>5} {n:7.0f} {n / total:6.1%}  {r['Source'].strip():<48} {why}")
    mix = Counter()
    for r in rows:
        mix[opcode(r["Source"])] += _number(r.get(EXECUTED, "0"))
    lines.append("  executed warp-instructions by opcode (the 15 most):")
    lines += [f"    {op:<28} {n:12.0f} {n / executed:6.1%}" for op, n in mix.most_common(15) if executed]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --print-source sass --csv output (.gz too)")
    parser.add_argument("--top", type=int, default=25, help="instructions to list a kernel (default 25)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top: expected >= 1, got {args.top}")
    if not args.csv.is_file():
        parser.error(f"{args.csv}: expected a file, got none there")
    data = args.csv.read_bytes()
    text = gzip.decompress(data).decode() if data[:2] == b"\x1f\x8b" else data.decode()
    try:
        kernels = read_kernels(text)
    except ValueError as exc:
        parser.error(f"{args.csv}: {exc}")
    for kernel in kernels:
        print("\n".join(summary(kernel, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
