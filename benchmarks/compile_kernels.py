"""Compile every fused Triton kernel for a GPU, on a machine without one.

    python benchmarks/compile_kernels.py [--arch 90] [--weights bf16,native] [--batches 1,3,4]

The CPU tests run the kernels under Triton's interpreter, which accepts what compiled Triton
refuses: the first GPU run of the native-format kernels (2026-12-05) failed 26 tests on one such
line, an integer ``other`` for a masked fp8 load. This script runs bench_kernels.py's case of
every fused op (small shapes, each batch given, both weight formats) on CPU tensors with Triton's
driver swapped for one whose launches only compile: through ptxas to a cubin for ``--arch``, with
the options a GPU of that arch takes (e4m3 codes loaded as fp8, programmatic dependent launch).
Nothing executes and no output is read. One line per case; exit status 1 if any case failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: jit makes compiled kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

COMPILED: set[tuple[str, int]] = set()  # (kernel, id of its compiled binary)


class CompileOnlyDriver:
    """Triton's driver interface as far as a launch needs it before the binary is loaded."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def install(arch: int) -> None:
    """Every launch from now on compiles (cached as usual) and returns without running."""
    driver.set_active(CompileOnlyDriver(arch))
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.add((self.fn.__qualname__, id(kernel)))
        return kernel

    JITFunction.run = compile_only
    # The launch options of a GPU (the ops decide them from the tensors' device, here the CPU).
    from draftgraph.ops.triton import _common, fp8_linear, moe_mxfp4

    _common.pdl_enabled = lambda device: arch >= 90  # as _common._pdl_supported decides on a GPU
    fp8_linear.native_fp8_supported = moe_mxfp4.native_fp8_supported = lambda device: arch >= 89


def _load_sibling(name: str):
    """benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# W8A8 (activations="fp8"): the native ops again with the rounding launches (fp8_round_rows)
W8A8_CASES = {"w8a8 attention": "swa_attention", "w8a8 moe": "moe"}


def edge_tiles(b: int) -> None:
    """The GEMVs at shapes no K tile divides (320 columns): the masked loads the op cases' even
    shapes never take, FP8 with one weight and with two, and bf16."""
    from draftgraph.ops.triton.fp8_linear import fp8_gemv
    from draftgraph.ops.triton.gemv import gemv
    from draftgraph.runtime.model.quant import quantize_fp8

    x = torch.randn(b, 320, dtype=torch.bfloat16)
    w = torch.randn(200, 320, dtype=torch.bfloat16)
    q, s = quantize_fp8(w)
    fp8_gemv(x, q, s, torch.empty(b, 200, dtype=torch.bfloat16))
    q2, s2 = quantize_fp8(w[:192])  # two weights: a row block must not straddle them (16-row tiles)
    fp8_gemv(x, q2, s2, torch.empty(b, 384, dtype=torch.bfloat16), w2=q2, w2_scale=s2)
    gemv(x, w, torch.empty(b, 200, dtype=torch.bfloat16))


def native_combiner(b: int) -> None:
    """The combiner on FP8 e_proj / h_proj (bench_kernels has no such case): the two-launch path
    (its norms kernel and the two-Ks GEMV) and the per-half one (more rows than COMBINER_MAX_ROWS),
    each with W8A8 too (the norms writing their rows rounded)."""
    from draftgraph.ops.triton import combiner as C
    from draftgraph.runtime.ir.tensor_spec import TensorSpec
    from draftgraph.runtime.model.quant import QuantWeight, quantize_fp8

    d, c = 4096, 4
    proj = QuantWeight(*quantize_fp8(torch.randn(d, d, dtype=torch.bfloat16)), fmt="fp8")
    for rows_b in (b, C.COMBINER_MAX_ROWS // c + 1):
        e, h = torch.randn(rows_b, d, dtype=torch.bfloat16), torch.randn(rows_b, c, d, dtype=torch.bfloat16)
        norm = torch.ones(d, dtype=torch.bfloat16)
        inputs = [e, h, norm, norm, proj, proj]
        w = TensorSpec(tuple(proj.data.shape), proj.data.dtype, "fp8",
                       TensorSpec(tuple(proj.scale.shape), torch.float8_e8m0fnu))  # fmt: skip
        specs = [TensorSpec(tuple(t.shape), t.dtype) for t in (e, h, norm, norm)] + [w, w]
        for attrs in ({"eps": 1e-6}, {"eps": 1e-6, "activations": "fp8"}):
            nbytes = C.combiner_workspace(specs, attrs, rows_b)
            workspace = torch.empty(nbytes, dtype=torch.uint8) if nbytes else None
            C.combiner_impl(inputs, [torch.empty_like(h)], attrs, workspace)


def nonfinite(b: int) -> None:
    """drop_nonfinite and mark_dropped (no bench_kernels case: they are not weight-bound)."""
    from draftgraph.ops.triton.nonfinite import drop_nonfinite_impl, mark_dropped_impl

    positions = torch.arange(b, dtype=torch.int64)
    drop_nonfinite_impl([positions, torch.randn(b, 4, 4096, dtype=torch.bfloat16)], [positions.clone()], {}, None)
    drafts = torch.zeros(b, 3, dtype=torch.int64)
    mark_dropped_impl([drafts, positions], [drafts], {}, None)


def acceptance(b: int) -> None:
    """The device verify's clamp_drafts and accept_drafts (K = 3, V4-Flash hidden rows [4, 4096])."""
    from draftgraph.ops.triton.acceptance import accept_drafts, clamp_drafts

    k, w = 3, 4
    drafts, tokens = torch.zeros(b, k, dtype=torch.int64), torch.zeros(b * w, dtype=torch.int64)
    clamp_drafts(drafts, tokens, 100)
    hidden = torch.zeros(b * w, 4, 4096, dtype=torch.bfloat16)
    next_hidden = torch.zeros(b, 4, 4096, dtype=torch.bfloat16)
    pair = torch.zeros(b, w + 1, 4, 4096, dtype=torch.bfloat16)
    accept_drafts(drafts, tokens, hidden, next_hidden, pair, torch.zeros(b, 3 + w, dtype=torch.int64))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: H100 / H200)")
    ap.add_argument("--weights", default="bf16,native", help="comma list of bf16 / native")
    ap.add_argument("--batches", default="1,3,4", help="batch sizes (1: the FMA kernels, more: the dot ones)")
    args = ap.parse_args(argv)
    weights = [w for w in args.weights.split(",") if w]
    if not weights or any(w not in ("bf16", "native") for w in weights):
        ap.error(f"--weights: expected a comma list of bf16 / native, got {args.weights!r}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or any(b < 1 or b > 64 for b in batches):
        ap.error(f"--batches: expected a comma list of sizes 1..64, got {args.batches!r}")

    install(args.arch)
    bk = _load_sibling("bench_kernels")
    from draftgraph.ops.triton import _impls
    from draftgraph.runtime.model.config import V4Config

    bk.DEV, bk.DRY = "cpu", True
    impls, cfg = _impls(), V4Config.small()
    print(f"triton {triton.__version__}, target sm_{args.arch}, torch {torch.__version__}")
    failed = 0
    for w in weights:
        bk.WEIGHTS = w
        names = [n for n in bk.CASES if w == "bf16" or n in bk.NATIVE]
        extra = ["edge tiles", "combiner", *W8A8_CASES] if w == "native" else ["nonfinite", "acceptance"]
        for name in names + extra:
            for b in batches:
                before, t0 = len(COMPILED), time.time()
                try:
                    if name == "edge tiles":
                        edge_tiles(b)
                    elif name == "combiner" and w == "native":
                        native_combiner(b)
                    elif name == "nonfinite":
                        nonfinite(b)
                    elif name == "acceptance":
                        acceptance(b)
                    else:
                        op = W8A8_CASES.get(name, name)
                        inputs, attrs = bk.make_case(op, cfg, b)
                        attrs = {**attrs, "activations": "fp8"} if name in W8A8_CASES else attrs
                        bk.run_once(op, impls[op], inputs, attrs, bk.workspace_for(op, inputs, attrs))
                    status = f"ok, {len(COMPILED) - before} new kernel(s)"
                except Exception as exc:  # a compile error, or anything else on the way to one
                    failed += 1
                    status = f"FAILED {type(exc).__name__}"
                    traceback.print_exc()
                print(f"{w:7s} {name:14s} B={b:<3d} {status} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{len(COMPILED)} kernels compiled for sm_{args.arch}; {failed} case(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
