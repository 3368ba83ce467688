"""benchmarks/ncu_sass.py: ncu's SASS source page summarised, on a real H100 profile (tests/data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ncu_sass
import pytest
from golden_files import check_golden

ROOT = Path(__file__).resolve().parents[1]
SAVED = ROOT / "tests" / "data" / "ncu_combiner_gemv_sass_731e6f3_h100.csv.gz"


def _run(*args):
    return subprocess.run([sys.executable, "benchmarks/ncu_sass.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


def test_the_summary_of_a_saved_profile():
    """The combiner's FP8 GEMV at 731e6f3: a third of its samples on the byte stores of its K loop
    (the finding its closing note made by hand), the reasons summing to the samples."""
    done = _run(SAVED, "--top", 12)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("kernel _fp8_gemv_kernel: 1472 SASS instructions, 3253 stall samples, "
                        "13403648 warp-instructions executed")
    by_reason = [line.split() for line in lines[2:] if line.startswith("    stall_")]
    assert sum(int(words[1]) for words in by_reason) == 3253
    assert sum(1 for line in lines if "STS.U8" in line and "long_sb" in line) == 4
    check_golden("ncu_sass_combiner_gemv.txt", done.stdout)


def test_two_kernels_in_one_file_are_summarised_apart():
    text = ('"Kernel Name","_a_kernel",\n"Address","Source","Warp Stall Sampling (All Samples)",'
            '"Instructions Executed","stall_wait","stall_long_sb"\n'
            '"0x10","  @!P0 LDG.E.128 R4, [R2.64]","5","8","1","4"\n'
            '"Kernel Name","_b_kernel",\n"Address","Source","Warp Stall Sampling (All Samples)",'
            '"Instructions Executed","stall_wait","stall_long_sb"\n'
            '"0x20","  FFMA R1, R2, R3, R4","3","16","3","-"\n')
    a, b = ncu_sass.read_kernels(text)
    assert (a.name, b.name) == ("_a_kernel", "_b_kernel")
    assert ncu_sass.summary(a)[:3] == [
        "kernel _a_kernel: 1 SASS instructions, 5 stall samples, 8 warp-instructions executed",
        "  samples by reason:", "    stall_long_sb                   4  80.0%"]
    assert "    FFMA                                   16 100.0%" in ncu_sass.summary(b)
    assert ncu_sass.opcode("@!P0 LDG.E.128 R4, [R2.64]") == "LDG.E.128"


@pytest.mark.parametrize("content, expected", [
    (None, "expected a file, got none there"),
    ("Address,Source\n", 'expected ncu --page source --csv output (a "Kernel Name" line first), found none'),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, expected):
    path = tmp_path / "sass.csv"
    if content is not None:
        path.write_text(content)
    done = _run(path)
    assert done.returncode == 2
    assert expected in done.stderr.splitlines()[-1]
