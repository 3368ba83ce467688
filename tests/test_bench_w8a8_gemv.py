"""benchmarks/bench_w8a8_gemv.py refuses bad input in one line with exit code 2, before any GPU work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,expected", [
    (["--batches", "x"], "--batches: expected a comma list of ints, got 'x'"),
    (["--batches", "8,0"], "--batches: expected rows in [1, 64] (fp8_gemv's skinny GEMMs), got '8,0'"),
    (["--batches", "65"], "--batches: expected rows in [1, 64] (fp8_gemv's skinny GEMMs), got '65'"),
])
def test_bad_batches_are_one_line_and_exit_2(argv, expected):
    done = subprocess.run([sys.executable, "benchmarks/bench_w8a8_gemv.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and expected in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_no_cuda_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "benchmarks/bench_w8a8_gemv.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "bench_w8a8_gemv.py: expected a CUDA device, got none (hint: run it on a GPU machine)"]
