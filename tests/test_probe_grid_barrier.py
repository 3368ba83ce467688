"""benchmarks/probe_grid_barrier.py: its kernels' math and barrier under Triton's interpreter, their
compile for sm_90, and its bad arguments. (The probe's timings need a GPU: benchmarks/h200/README.md.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "probe_grid_barrier.py"
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors through Triton's interpreter")


def _probe():
    spec = importlib.util.spec_from_file_location("probe_grid_barrier", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@interpreted
def test_the_chain_in_one_launch_equals_a_launch_a_phase_and_the_float64_chain():
    probe = _probe()
    w, ys = probe.make_chain(3, 64, "cpu")
    probe.run_separate(w, ys, block_n=8, block_k=32)
    separate = ys.clone()
    ys[1:] = 0
    counter, failed = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    probe.run_persistent(w, ys, counter, failed, grid=1, block_n=8, block_k=32)
    assert torch.equal(ys, separate)  # one tile function, the same sums
    assert counter.item() == 3 and failed.item() == 0  # a barrier a phase, none spun out
    y = ys[0].double()
    for p in range(3):
        y = w[p].double() @ y
        torch.testing.assert_close(ys[p + 1].double(), y, rtol=1e-5, atol=1e-5)


@interpreted
def test_the_barrier_counts_arrivals_and_flags_a_grid_whose_programs_are_not_all_resident():
    probe = _probe()
    counter, failed = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    probe.run_barriers(counter, failed, grid=1, count=5)
    assert (counter.item(), failed.item()) == (5, 0)
    # The interpreter runs programs one after another: the first waits for a second that has not
    # started, as a program past the resident ones would on a GPU; it gives up and flags the launch.
    probe.run_barriers(counter, failed, grid=2, count=1, max_spin=50)
    assert (counter.item(), failed.item()) == (2, 1)


def test_the_kernels_compile_for_sm90(tmp_path):
    script = tmp_path / "compile_probe.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util
        def load(name, path):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        compile_kernels = load("compile_kernels", {str(ROOT / "benchmarks" / "compile_kernels.py")!r})
        compile_kernels.install(90)  # before the probe's kernels launch: each launch compiles, none runs
        probe = load("probe_grid_barrier", {str(SCRIPT)!r})
        import torch
        w, ys = torch.zeros(4, 512, 512, dtype=torch.bfloat16), torch.zeros(5, 512)
        counter, failed = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        probe.run_separate(w, ys, pdl=True)
        for prefetch in (False, True):
            probe.run_persistent(w, ys, counter, failed, grid=132, prefetch=prefetch)
        probe.run_barriers(counter, failed, grid=132, count=64)
        probe._tiny_kernel[(132,)](counter, PDL=True, launch_pdl=True)
        print(sorted(name for name, _ in compile_kernels.COMPILED))
    """))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(sorted(["_barriers_kernel", "_gemv_kernel", "_persistent_chain_kernel",
                                              "_persistent_chain_kernel", "_tiny_kernel"])), done.stdout


@pytest.mark.parametrize("argv,expected", [
    (["--phases", "1"], "--phases: expected an int >= 2, got 1"),
    (["--n", "300"], "--n: expected a multiple of 256, got 300"),
    (["--rounds", "0"], "--rounds: expected an int >= 1, got 0"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, expected):
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"probe_grid_barrier.py: {expected}", done.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_no_cuda_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert done.stderr.startswith("probe_grid_barrier.py: expected a CUDA device, got none (hint:")
