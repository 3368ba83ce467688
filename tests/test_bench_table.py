"""The bench_draft table printer, on a saved H200 run (tests/data, from benchmarks/h200): golden text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from golden_files import check_golden

ROOT = Path(__file__).resolve().parents[1]


def test_bench_draft_table_of_a_saved_run():
    saved = ROOT / "tests" / "data" / "bench_draft_b8_b32_381ba0b.json"
    out = subprocess.run([sys.executable, "benchmarks/bench_draft.py", "--table", str(saved)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "draftgraph captured, fused ops" in out
    check_golden("bench_table_b8_b32.txt", out + "\n")


def test_bench_draft_table_of_a_native_and_bf16_run():
    """Both weight formats and the propose call's split: the second table names each row's weights and
    its launch (the host's spells show there: the same driver call 3x slower)."""
    saved = ROOT / "tests" / "data" / "bench_draft_native_bf16_2109df7_h100.json"
    out = subprocess.run([sys.executable, "benchmarks/bench_draft.py", "--table", str(saved)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert " 32  1  native  draftgraph captured, fused ops " in out
    check_golden("bench_table_native_bf16.txt", out + "\n")
