"""Every fused Triton kernel compiles for sm_90 on this CPU machine (benchmarks/compile_kernels.py).

The other CPU tests run the kernels under Triton's interpreter, which accepts code that
compiled Triton refuses; here the launches compile through ptxas to cubins instead (nothing
runs). The second test shows the check catches such a line: the masked fp8 load with an
integer ``other`` that failed 26 GPU tests on 2026-12-05 and ran under the interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compile_kernels.py"


# The head of a script that compiles launches for sm_90 and keeps each compiled kernel in
# ``kernels`` (its PTX: ``kernels[-1].asm["ptx"]``): the PTX checks below.
COMPILED_LAUNCHES = textwrap.dedent(f"""
    import importlib.util
    import re
    spec = importlib.util.spec_from_file_location("compile_kernels", {str(SCRIPT)!r})
    compile_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_kernels)
    import torch
    from triton.runtime.jit import JITFunction

    compile_kernels.install(90)
    kernels, run = [], JITFunction.run
    JITFunction.run = lambda self, *a, **kw: kernels.append(run(self, *a, **kw)) or kernels[-1]
""")


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


def test_the_fp8_gemv_reads_its_weight_tiles_wide_in_every_variant(tmp_path):
    """fp8_gemv's note "aligned rows": where a program's matrix or K part is picked at run time
    (TWO_W: wq_a + wkv; CAT_K: the combiner's two Ks), Triton lost the weight rows' 16-byte
    alignment (3.6 after ``if`` branches, 3.9 after ``tl.where``) and read the tiles a byte a
    load, outside cp.async (the combiner's GEMV at 33% of DRAM on an H100). Compiled for sm_90,
    each variant's PTX may hold only the scale bytes' loads as byte loads. Without the hints this
    failed with 64 byte loads a variant (the branches under 3.6, the selects under 3.9)."""
    script = tmp_path / "byte_loads.py"
    script.write_text(COMPILED_LAUNCHES + textwrap.dedent("""
        from draftgraph.ops.triton import fp8_linear as F

        def weight(n, k):
            return torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.zeros(n // 128, k // 128, dtype=torch.uint8)

        k = 1024
        (w, s), (w2, s2), (wa, sa), (wb, sb) = weight(512, k), weight(512, k), weight(256, k), weight(128, k)
        for rows in (1, 4, 32):
            x, x2 = torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(1, k, dtype=torch.bfloat16)
            parts, counts = torch.zeros(4 * rows * 512), torch.zeros(64, dtype=torch.int32)
            cases = {
                "plain": lambda: F.fp8_gemv(x, w, s, torch.zeros(rows, 512, dtype=torch.bfloat16)),
                "two_w": lambda: F.fp8_gemv(x, wa, sa, torch.zeros(rows, 384, dtype=torch.bfloat16), w2=wb,
                                            w2_scale=sb),
                "cat_k": lambda: F.fp8_gemv(x, w, s, torch.zeros(rows, 512, dtype=torch.bfloat16), w2=w2,
                                            w2_scale=s2, x2=x2, x2_row_div=rows, split_k=4,
                                            split_reduce=(parts, counts)),
            }
            for name, launch in cases.items():
                launch()
                ptx = kernels[-1].asm["ptx"]
                loads = [line for line in ptx.splitlines() if line.strip().startswith("ld.global")]
                wide = sum(".v4." in line or ".v2." in line for line in loads) + ptx.count("cp.async.cg")
                narrow = sum(".b8 " in line or ".u8 " in line for line in loads)
                print(name, rows, narrow, wide)
    """))
    done = _python([str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 9, done.stdout
    for name, batch, narrow, wide in rows:
        assert int(narrow) <= 8 and int(wide) > 0, f"{name} at {batch} rows: {narrow} byte loads, {wide} wide"


def test_the_bf16_grouped_moe_reads_its_weight_tiles_wide(tmp_path):
    """moe_grouped's note "aligned rows": the expert's weight rows are picked at run time (the
    shared expert's matrix or the slot's), and Triton 3.9 lost their alignment there: w13 read its
    bf16 tiles with 128 two-byte loads a thread, outside cp.async (3.6 kept cp.async). Compiled for
    sm_90, the w13 and w2 launches may hold no 8- or 16-bit global load. Without the hints this
    failed under 3.9 (the PTX's predicated ``ld.global.b16``)."""
    script = tmp_path / "narrow_loads.py"
    script.write_text(COMPILED_LAUNCHES + textwrap.dedent(r"""
        from draftgraph.ops.triton import moe_grouped
        from draftgraph.ops.triton.gemv import GemvConfig

        b, d, inter, experts, top_k = 4, 512, 256, 8, 2
        bf = torch.bfloat16
        x, out = torch.zeros(b, d, dtype=bf), torch.zeros(b, d, dtype=bf)
        idx, wts = torch.zeros(b, top_k, dtype=torch.int32), torch.zeros(b, top_k)
        w1, w3 = torch.zeros(experts, inter, d, dtype=bf), torch.zeros(experts, inter, d, dtype=bf)
        w2 = torch.zeros(experts, d, inter, dtype=bf)
        sw1, sw3 = torch.zeros(inter, d, dtype=bf), torch.zeros(inter, d, dtype=bf)
        sw2 = torch.zeros(d, inter, dtype=bf)
        act, part = torch.zeros(b * top_k + b, inter, dtype=bf), torch.zeros(b * top_k + b, d)
        tiles = GemvConfig(64, 128, 4, 3)
        for name, launch in moe_grouped.launches(x, idx, wts, w1, w3, w2, sw1, sw3, sw2, act, part, out, top_k,
                                                 7.0, tiles, tiles, 16, False):
            if name in ("w13", "w2"):
                launch()
                ptx = kernels[-1].asm["ptx"]
                narrow = len(re.findall(r"ld\.global(?:\.\w+)*\.[bu](?:8|16) ", ptx))
                print(name, narrow, ptx.count("cp.async.cg.shared.global"))
    """))
    done = _python([str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [row[0] for row in rows] == ["w13", "w2"], done.stdout
    for name, narrow, copies in rows:
        assert int(narrow) == 0 and int(copies) > 0, f"{name}: {narrow} narrow loads, {copies} cp.async"


def test_the_w8a8_gemv_multiplies_fp8_codes_on_wgmma(tmp_path):
    """fp8_linear's note "W8A8 on the tensor cores": with act_fp8 on 64-row tiles, sm_90's
    warpgroup MMA multiplies e4m3 codes by e4m3 codes (no decode of the weight tile to bf16);
    on the 32-row tiles the compiler takes the mma.sync path (codes converted for it)."""
    script = tmp_path / "w8a8.py"
    script.write_text(COMPILED_LAUNCHES + textwrap.dedent("""
        from draftgraph.ops.triton import fp8_linear as F
        from draftgraph.ops.triton.gemv import GemvConfig

        w, s = torch.zeros(512, 1024, dtype=torch.float8_e4m3fn), torch.zeros(4, 8, dtype=torch.uint8)
        for rows, cfg in ((8, GemvConfig(64, 128, 4, 4)), (32, GemvConfig(64, 128, 4, 4)), (32, F.DEFAULT)):
            x, out = torch.zeros(rows, 1024, dtype=torch.bfloat16), torch.zeros(rows, 512, dtype=torch.bfloat16)
            F.fp8_gemv(x, w, s, out, config=cfg, act_fp8=True, native_fp8=True)
            ptx = kernels[-1].asm["ptx"]
            fp8_mma = sum("wgmma.mma_async" in line and "e4m3.e4m3" in line for line in ptx.splitlines())
            print(rows, cfg.block_n, fp8_mma)
    """))
    done = _python([str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = [line.split() for line in done.stdout.splitlines()]
    assert [(r, n) for r, n, _ in counts] == [("8", "64"), ("32", "64"), ("32", "32")], done.stdout
    assert int(counts[0][2]) > 0 and int(counts[1][2]) > 0, counts


def test_the_w8a8_wq_b_tiles_and_the_rounding_kernel_compile_as_their_notes_say(tmp_path):
    """The attention's W8A8 wq_b from 8 rows (Q_W8A8_CORE_CONFIG) multiplies on the FP8 warpgroup
    MMA; fp8_round_rows' ``(y + 2^23) - 2^23`` (its note "rounding by arithmetic") survives the
    compiler: the add of -2^23 is in the PTX (the first add may fuse into the exact power-of-two
    product as an fma: one rounding either way)."""
    script = tmp_path / "w8a8_chain.py"
    script.write_text(COMPILED_LAUNCHES + textwrap.dedent("""
        from draftgraph.ops.triton import attention as A
        from draftgraph.ops.triton import fp8_linear as F
        from draftgraph.ops.triton.fp8_round import fp8_round_rows

        rows = A.Q_W8A8_CORE_MIN_ROWS
        w, s = torch.zeros(1024, 256, dtype=torch.float8_e4m3fn), torch.zeros(8, 2, dtype=torch.uint8)
        x, out = torch.zeros(rows, 256, dtype=torch.bfloat16), torch.zeros(rows, 1024, dtype=torch.bfloat16)
        F.fp8_gemv(x, w, s, out, config=A.Q_W8A8_CORE_CONFIG, act_fp8=True, native_fp8=True)
        ptx = kernels[-1].asm["ptx"]
        print("wq_b", sum("wgmma.mma_async" in line and "e4m3.e4m3" in line for line in ptx.splitlines()))
        fp8_round_rows(torch.zeros(3, 300, dtype=torch.bfloat16))
        ptx = kernels[-1].asm["ptx"]
        print("round", sum(bool(re.search(r"(add|sub)\\.(rn\\.)?f32.*0fCB000000", line)) for line in ptx.splitlines()))
    """))
    done = _python([str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert int(counts["wq_b"]) > 0, done.stdout
    assert int(counts["round"]) >= 1, done.stdout


def test_sass_mix_reads_each_variants_registers_and_k_loop(tmp_path):
    """benchmarks/sass_mix.py on sm_90: a row a variant at batch 1 and 8 with its registers and a K
    loop found in the disassembly (fails if the compile-only driver, the disassembly or the loop's
    parse breaks), no stack, the FP8 decode (F2FP) in every loop and the FMA tiles' loops built on FFMA."""
    done = _python(["benchmarks/sass_mix.py", "--batches", "1,8"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = re.compile(r"B=(\d+) (fma|dot) +(\S+) .*regs +(\d+) stack +(\d+) kernel +\d+ loop +(\d+): (.*)")
    rows = [m.groups() for m in map(row.match, done.stdout.splitlines()) if m]
    assert [(b, kind) for b, kind, *_ in rows] == [("1", "fma")] * 3 + [("8", "dot")] * 4, done.stdout
    assert all(int(regs) > 0 and stack == "0" and int(loop) > 50 for *_, regs, stack, loop, _ in rows), rows
    assert all("F2FP=" in r[6] and ("FFMA=" in r[6] or r[1] == "dot") for r in rows), rows
