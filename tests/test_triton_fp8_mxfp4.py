"""The FP8 block-scaled GEMV and the MXFP4 MoE kernels against float64 math on their dequantised weights.

Without CUDA the kernels run under Triton's CPU interpreter at tiny shapes (ragged edges
included); the ``cuda``-marked tests run them compiled at the V4-Flash shapes. Weights are
quantised by ``runtime.model.quant`` with per-tile magnitudes spread over many powers of two,
so a scale read from the wrong block shows as an O(1) error. Outputs are poisoned with NaN
(every element must be written) and compared by relative error against the float64 product
of the dequantised weights: fp32 outputs to summation-order error, bf16 outputs to their
rounding.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = not HAS_CUDA
if INTERPRET:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before `import triton` (see test_triton_kernels)
triton = pytest.importorskip("triton")
if INTERPRET and type(triton.language.standard.sum).__name__ == "JITFunction":
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1",
        allow_module_level=True,
    )
import triton.language as tl  # noqa: E402


def _load_kernel_modules():
    mods = {}
    for name in ["_common", "gemv", "moe_grouped", "fp8_linear", "moe_mxfp4"]:
        full = f"draftgraph.ops.triton.{name}"
        mod = sys.modules.get(full)
        mod = importlib.import_module(full) if mod is None else mod
        if INTERPRET and any(type(v).__name__ == "JITFunction" for v in vars(mod).values()):
            mod = importlib.reload(mod)  # imported earlier without the interpreter
        mods[name] = mod
    return mods


K = _load_kernel_modules()
if INTERPRET:
    K["_common"].patch_interpreter_rounding()
FP8, MX = K["fp8_linear"], K["moe_mxfp4"]

from draftgraph.runtime.errors import InputError  # noqa: E402
from draftgraph.runtime.model.quant import (  # noqa: E402
    E2M1_MAGNITUDES,
    dequantize_fp8,
    quantize_fp8,
)

cpu_only = pytest.mark.skipif(not INTERPRET, reason="the interpreter tests run where there is no CUDA")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DEVICES = [pytest.param("cpu", marks=cpu_only), pytest.param("cuda", marks=[cuda, needs_cuda])]
BF16 = torch.bfloat16


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """No unwritten (NaN) element, and the error of out's dtype: fp32 summation order, or bf16 rounding."""
    assert not torch.isnan(out).any(), f"{what}: unwritten (NaN) elements {torch.isnan(out).sum().item()}"
    err = rel_err(out, ref)
    limit = 2e-5 if out.dtype == torch.float32 else 6e-3
    assert err < limit, f"{what}: relative error {err:.2e} (limit {limit:.0e})"
    return err


def spread_weight(g: torch.Generator, rows: int, cols: int, tile: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] fp32, ~1/sqrt(cols) per entry, each (tile) block scaled by its own 2^[-6, 6]."""
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64) / math.sqrt(cols)
    grid = (-(-rows // tile[0]), -(-cols // tile[1]))
    exps = torch.randint(-6, 7, grid, generator=g).double()
    factor = torch.exp2(exps).repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[:, :cols]
    return (w * factor).float()


def act(g: torch.Generator, rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale + 0.05).to(BF16)


# ---- decoding: every byte ---------------------------------------------------------------------


@triton.jit
def _decode_kernel(fp8_ptr, ue8m0_ptr, e2m1_ptr, out_fp8, out_ue8m0, out_e2m1):
    offs = tl.arange(0, 256)
    tl.store(out_fp8 + offs, FP8.e4m3_to_f32(tl.load(fp8_ptr + offs)))
    tl.store(out_ue8m0 + offs, FP8.ue8m0_to_f32(tl.load(ue8m0_ptr + offs)))
    codes = tl.arange(0, 16)
    tl.store(out_e2m1 + codes, MX.e2m1_to_f32(tl.load(e2m1_ptr + codes).to(tl.int32)))


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN at {torch.isnan(got).nonzero().flatten().tolist()}"
    g, w = got[~nan].view(torch.int32), want[~nan].view(torch.int32)  # bits: -0.0 and subnormals count
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} codes differ, first {got[~nan][bad[:4]]} vs {want[~nan][bad[:4]]}"


@pytest.mark.parametrize("device", DEVICES)
def test_decode_every_code_bit_exact(device):
    """e4m3 (subnormals, -0, NaN 0x7F / 0xFF), UE8M0 (2^-127 .. 2^127, NaN 255) and e2m1, against torch."""
    byte = torch.arange(256, dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8)
    outs = [torch.full((n,), float("nan"), device=device) for n in (256, 256, 16)]
    _decode_kernel[(1,)](byte.to(device), byte.to(device), codes.to(device), *outs)
    table = torch.tensor(E2M1_MAGNITUDES)
    _same_bits(outs[0].cpu(), byte.view(torch.float8_e4m3fn).float(), "e4m3")
    _same_bits(outs[1].cpu(), byte.view(torch.float8_e8m0fnu).float(), "ue8m0")
    _same_bits(outs[2].cpu(), torch.cat([table, -table]), "e2m1")


# ---- fp8_gemv ---------------------------------------------------------------------------------


def fp8_weight(g, rows, cols, device):
    q, s = quantize_fp8(spread_weight(g, rows, cols, (128, 128)))
    return q.to(device), s.to(device), dequantize_fp8(q, s, torch.float64)


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


FMA = K["gemv"].GemvConfig(block_n=8, block_k=64, num_warps=4, num_stages=2, use_dot=False)
DOT = K["gemv"].GemvConfig(block_n=32, block_k=64, num_warps=4, num_stages=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch,n,k,cfg,out_dtype",
    [
        (1, 200, 320, "fma", torch.float32),  # ragged N and K: 2 x 3 scale blocks, the last ones partial
        (1, 200, 320, "dot", BF16),
        (3, 136, 256, "dot", torch.float32),
        (17, 96, 200, "dot", BF16),  # K tile past the end of K; 17 rows: a 32-row activation tile
        (2, 256, 128, "fma", BF16),  # FMA asked for at batch 2 runs as dot
    ],
)
def test_fp8_gemv(device, batch, n, k, cfg, out_dtype):
    g = gen(1000 + n + k + batch)
    q, s, w64 = fp8_weight(g, n, k, device)
    x = act(g, batch, k).to(device)
    out = poisoned((batch, n), out_dtype, device)
    FP8.fp8_gemv(x, q, s, out, config=FMA if cfg == "fma" else DOT)
    check(out.cpu(), x.cpu().double() @ w64.T, f"fp8_gemv {batch}x{k} @ {n}x{k} {cfg}")


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemv_two_weights_and_grouped(device):
    """wq_a + wkv in one launch (each with its own scale grid), and wo_a's grouped columns."""
    g = gen(1101)
    qa, sa, wa = fp8_weight(g, 192, 256, device)  # 192 rows: the second matrix starts mid scale block
    qb, sb, wb = fp8_weight(g, 72, 256, device)
    x = act(g, 2, 256).to(device)
    out = poisoned((2, 264), BF16, device)
    FP8.fp8_gemv(x, qa, sa, out, w2=qb, w2_scale=sb, config=DOT)
    check(out.cpu(), x.cpu().double() @ torch.cat([wa, wb]).T, "fp8_gemv two weights")
    out1 = poisoned((1, 264), torch.float32, device)
    FP8.fp8_gemv(x[:1], qa, sa, out1, w2=qb, w2_scale=sb, config=FMA)
    check(out1.cpu(), x[:1].cpu().double() @ torch.cat([wa, wb]).T, "fp8_gemv two weights fma")

    qg, sg, wg = fp8_weight(g, 2 * 64, 160, device)  # 2 groups of 64 rows, 160 columns each
    xg = act(g, 3, 2 * 160).to(device)
    ref = torch.cat([xg.cpu().double()[:, i * 160 : (i + 1) * 160] @ wg[i * 64 : (i + 1) * 64].T for i in range(2)], 1)
    out = poisoned((3, 128), torch.float32, device)
    FP8.fp8_gemv(xg, qg, sg, out, group_rows=64, config=DOT)
    check(out.cpu(), ref, "fp8_gemv grouped")


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemv_norm_split_accumulate_strided(device):
    g = gen(1102)
    q, s, w64 = fp8_weight(g, 144, 256, device)
    x = act(g, 2, 256, scale=3.0).to(device)
    nw = (1 + 0.1 * torch.randn(256, generator=g)).to(BF16).to(device)
    # The prologue's norm rounds to bf16 as the reference's norm output does.
    xd = x.cpu().double()
    normed = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * nw.cpu().double()).to(BF16).double()
    out = poisoned((2, 144), torch.float32, device)
    FP8.fp8_gemv(x, q, s, out, norm_w=nw, eps=1e-6, config=DOT)
    check(out.cpu(), normed @ w64.T, "fp8_gemv normed")

    parts = poisoned((2, 1, 144), torch.float32, device)
    FP8.fp8_gemv(x[:1], q, s, parts, split_k=2, config=FMA)
    check(parts.sum(0).cpu(), xd[:1] @ w64.T, "fp8_gemv split-K")
    assert rel_err(parts[0].cpu(), xd[:1, :128] @ w64[:, :128].T) < 2e-5  # each split its own K half

    wide = poisoned((3, 400), BF16, device)  # out a strided view [2, 144] of it; x a view too
    residual = act(g, 2, 144).to(device)
    view = wide[1:3, 100:244]
    view.copy_(residual)
    xs = torch.cat([x, x], 1)[:, 256:]
    FP8.fp8_gemv(xs, q, s, view, accumulate=True, config=DOT)
    check(view.cpu(), residual.cpu().double() + xd @ w64.T, "fp8_gemv accumulate")
    assert torch.isnan(wide[0]).all() and torch.isnan(wide[1:, :100]).all() and torch.isnan(wide[1:, 244:]).all()


def test_fp8_gemv_rejects_bad_inputs():
    g = gen(1103)
    q, s, _ = fp8_weight(g, 128, 128, "cpu")
    x, out = act(g, 1, 128), torch.empty(1, 128, dtype=BF16)
    with pytest.raises(InputError, match="w_scale"):
        FP8.fp8_gemv(x, q, s[:, :0], out)
    with pytest.raises(InputError, match="dtype"):
        FP8.fp8_gemv(x, q.float(), s, out)
    with pytest.raises(InputError, match="x"):
        FP8.fp8_gemv(x.float(), q, s, out)
