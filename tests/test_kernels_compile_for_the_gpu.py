"""Every fused Triton kernel compiles for sm_90 on this CPU machine (benchmarks/compile_kernels.py).

The other CPU tests run the kernels under Triton's interpreter, which accepts code that
compiled Triton refuses; here the launches compile through ptxas to cubins instead (nothing
runs). The second test shows the check catches such a line: the masked fp8 load with an
integer ``other`` that failed 26 GPU tests on 2026-12-05 and ran under the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compile_kernels.py"


def _python(argv: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}  # a fresh cache: every kernel compiled here
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_every_fused_kernel_compiles_for_sm90_both_weight_formats(tmp_path):
    done = _python(["benchmarks/compile_kernels.py", "--arch", "90", "--batches", "1,3"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert not [line for line in lines if "FAILED" in line]
    for case in ("bf16    moe            B=1", "native  moe            B=3", "native  edge tiles     B=1",
                 "bf16    acceptance     B=3"):
        assert any(line.startswith(case) and " ok, " in line for line in lines), case
    compiled = int(lines[-1].split()[0])
    assert compiled >= 40, lines[-1]  # the fresh cache: every kernel really went through ptxas
    assert len(list(tmp_path.rglob("*.cubin"))) == compiled


def test_the_native_kernels_compile_for_sm80_too(tmp_path):
    """The e2m1 PTX once multiplied with mul.rn.bf16x2, which needs sm_90: the native MoE failed
    to compile for an A100 (sm_80) and the sm_89 cards. (No PDL and no native fp8 loads there,
    as on such a GPU.)"""
    argv = ["benchmarks/compile_kernels.py", "--arch", "80", "--weights", "native", "--batches", "1,3"]
    done = _python(argv, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for case in ("native  moe            B=1", "native  moe            B=3"):  # B=3: moe_mxfp4_mma
        assert any(line.startswith(case) and " ok, " in line for line in lines), case


def test_the_check_catches_what_the_interpreter_runs(tmp_path):
    script = tmp_path / "bad_kernel.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("compile_kernels", {str(SCRIPT)!r})
        compile_kernels = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(compile_kernels)  # sets TRITON_INTERPRET=0 before triton is imported
        import torch
        import triton
        import triton.language as tl

        compile_kernels.install(90)

        @triton.jit
        def masked_fp8_load(w_ptr, out_ptr, n):
            offs = tl.arange(0, 128)
            q = tl.load(w_ptr + offs, mask=offs < n, other=0)  # int -> fp8e4nv: refused when compiled
            tl.store(out_ptr + offs, q.to(tl.float32), mask=offs < n)

        w = torch.zeros(128, dtype=torch.float8_e4m3fn)
        try:
            masked_fp8_load[(1,)](w, torch.empty(128), 100)
        except triton.compiler.errors.CompilationError as exc:
            print("refused:", "cannot cast" in str(exc.__cause__) or "cannot cast" in str(exc))
        else:
            print("compiled")
    """))
    done = _python([str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "refused: True", done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("argv,expected", [
    (["--weights", "fp4"], "--weights: expected a comma list of bf16 / native, got 'fp4'"),
    (["--batches", "0"], "--batches: expected a comma list of sizes 1..64, got '0'"),
    (["--batches", "x"], "--batches: expected a comma list of sizes 1..64, got 'x'"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, argv, expected):
    done = _python([str(SCRIPT), *argv], tmp_path)
    assert done.returncode == 2 and expected in done.stderr, done.stderr[-2000:]
    assert not list(tmp_path.rglob("*.cubin"))  # refused before anything compiled
