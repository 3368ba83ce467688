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

import math

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import HAS_CUDA, INTERPRET, load_kernel_modules, triton

tl = triton.language

K = load_kernel_modules(["_common", "fp8_round", "gemv", "moe_grouped", "fp8_linear", "moe_mxfp4"])
FP8, MX = K["fp8_linear"], K["moe_mxfp4"]

from draftgraph.runtime.errors import InputError  # noqa: E402
from draftgraph.runtime.model.config import V4Config  # noqa: E402
from draftgraph.runtime.model.quant import (  # noqa: E402
    E2M1_MAGNITUDES,
    dequantize_fp8,
    dequantize_mxfp4,
    fp8_round_activations,
    quantize_fp8,
    quantize_mxfp4,
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
WIDE = K["gemv"].GemvConfig(block_n=8, block_k=256, num_warps=4, num_stages=2, use_dot=False)  # 2 scale blocks a tile
CONFIGS = {"fma": FMA, "dot": DOT, "wide": WIDE}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch,n,k,cfg,out_dtype",
    [
        (1, 200, 320, "fma", torch.float32),  # ragged N and K: 2 x 3 scale blocks, the last ones partial
        (1, 200, 320, "dot", BF16),
        (1, 200, 320, "wide", BF16),  # the second K tile: one whole scale block and a partial one
        (1, 72, 640, "wide", torch.float32),  # K tiles of 2 x 128, the last one past K
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
    FP8.fp8_gemv(x, q, s, out, config=CONFIGS[cfg])
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
    out1 = poisoned((1, 264), torch.float32, device)
    FP8.fp8_gemv(x[:1], qa, sa, out1, w2=qb, w2_scale=sb, config=WIDE)
    check(out1.cpu(), x[:1].cpu().double() @ torch.cat([wa, wb]).T, "fp8_gemv two weights wide")

    qg, sg, wg = fp8_weight(g, 2 * 64, 160, device)  # 2 groups of 64 rows, 160 columns each
    xg = act(g, 3, 2 * 160).to(device)
    ref = torch.cat([xg.cpu().double()[:, i * 160 : (i + 1) * 160] @ wg[i * 64 : (i + 1) * 64].T for i in range(2)], 1)
    out = poisoned((3, 128), torch.float32, device)
    FP8.fp8_gemv(xg, qg, sg, out, group_rows=64, config=DOT)
    check(out.cpu(), ref, "fp8_gemv grouped")
    out = poisoned((1, 128), torch.float32, device)
    FP8.fp8_gemv(xg[:1], qg, sg, out, group_rows=64, config=WIDE)  # a 256-column tile over a 160-column group
    check(out.cpu(), ref[:1], "fp8_gemv grouped wide")


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
    out = poisoned((1, 144), torch.float32, device)
    FP8.fp8_gemv(x[:1], q, s, out, norm_w=nw, eps=1e-6, config=WIDE)
    check(out.cpu(), normed[:1] @ w64.T, "fp8_gemv normed wide")

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [2, 4])
def test_fp8_gemv_split_k_reduced(device, split):
    """K in ``split`` programs a tile, summed by the tile's last part to finish ("split K, reduced"):
    plain, two weights, grouped, accumulating; every count ends at ``split``."""
    g = gen(1104)
    qa, sa, wa = fp8_weight(g, 96, 512, device)
    qb, sb, wb = fp8_weight(g, 32, 512, device)
    x = act(g, 3, 512).to(device)
    xd = x.cpu().double()

    def reduced(xx, q, s_, out, **kw):
        n = out.shape[1] if out.dim() == 2 else out.shape[-1]
        tiles = FP8.split_tiles(xx.shape[0], n, q.shape[0], q.shape[1], DOT, kw.get("w2") is not None,
                                kw.get("group_rows", 0), split)  # fmt: skip
        partials = poisoned((split * xx.shape[0] * n,), torch.float32, device)
        arrivals = torch.zeros(tiles, dtype=torch.int32, device=device)
        FP8.fp8_gemv(xx, q, s_, out, split_k=split, config=DOT, split_reduce=(partials, arrivals), **kw)
        assert arrivals.tolist() == [0] * tiles  # every tile's last part reset its count

    out = poisoned((3, 96), BF16, device)
    reduced(x, qa, sa, out)
    check(out.cpu(), xd @ wa.T, "fp8_gemv split reduced")
    whole = poisoned((3, 96), BF16, device)
    FP8.fp8_gemv(x, qa, sa, whole, config=DOT)
    assert rel_err(out.cpu(), whole.cpu()) < 1e-2

    out = poisoned((3, 128), torch.float32, device)
    reduced(x, qa, sa, out, w2=qb, w2_scale=sb)
    check(out.cpu(), xd @ torch.cat([wa, wb]).T, "fp8_gemv split reduced two weights")

    qg, sg, wg = fp8_weight(g, 2 * 64, 256, device)  # 2 groups of 64 rows, 256 columns each
    ref = torch.cat([xd[:, i * 256 : (i + 1) * 256] @ wg[i * 64 : (i + 1) * 64].T for i in range(2)], 1)
    out = poisoned((3, 128), BF16, device)
    reduced(x, qg, sg, out, group_rows=64)
    check(out.cpu(), ref, "fp8_gemv split reduced grouped")

    residual = act(g, 3, 96).to(device)
    out = residual.clone()
    reduced(x, qa, sa, out, accumulate=True)
    check(out.cpu(), residual.cpu().double() + xd @ wa.T, "fp8_gemv split reduced accumulate")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,div", [(8, 4), (3, 1), (1, 1)])  # streams (C = 4), collapsed, one row (FMA)
def test_fp8_gemv_two_ks(device, rows, div):
    """out[r] = x[r] @ W^T + x2[r // div] @ W2^T in one launch ("two Ks"), split over both Ks."""
    g = gen(1105)
    qa, sa, wa = fp8_weight(g, 96, 256, device)
    qb, sb, wb = fp8_weight(g, 96, 256, device)
    x, x2 = act(g, rows, 256).to(device), act(g, -(-rows // div), 256).to(device)
    ref = x.cpu().double() @ wa.T + x2.cpu().double()[torch.arange(rows) // div] @ wb.T
    for split in (2, 4):
        config = FP8.config_for(rows)
        tiles = FP8.split_tiles(rows, 96, 96, 512, config, split_k=split)
        partials = poisoned((split * rows * 96,), torch.float32, device)
        arrivals = torch.zeros(tiles, dtype=torch.int32, device=device)
        out = poisoned((rows, 96), BF16, device)
        FP8.fp8_gemv(x, qa, sa, out, w2=qb, w2_scale=sb, x2=x2, x2_row_div=div, split_k=split, config=config,
                     split_reduce=(partials, arrivals))  # fmt: skip
        check(out.cpu(), ref, f"fp8_gemv two Ks, split {split}")
        assert arrivals.tolist() == [0] * tiles
        out2 = poisoned((rows, 96), BF16, device)  # again on the same counts, not zeroed in between
        FP8.fp8_gemv(x, qa, sa, out2, w2=qb, w2_scale=sb, x2=x2, x2_row_div=div, split_k=split, config=config,
                     split_reduce=(partials, arrivals))  # fmt: skip
        assert torch.equal(out2.cpu(), out.cpu())
    with pytest.raises(InputError, match="two Ks"):  # an odd split would put a part across both matrices
        FP8.fp8_gemv(x, qa, sa, out, w2=qb, w2_scale=sb, x2=x2, x2_row_div=div, split_k=3,
                     split_reduce=(partials, arrivals))  # fmt: skip


def _batch1_outputs(g, device):
    """(name, fp32 output, float64 reference) for each batch-1 path of fp8_gemv:
    ragged N and K, one tile over several scale blocks, two weights (the second mid scale block),
    grouped columns, the prologue norm, split K, two Ks."""
    qa, sa, wa = fp8_weight(g, 200, 320, device)
    qb, sb, wb = fp8_weight(g, 72, 320, device)
    qg, sg, wg = fp8_weight(g, 2 * 64, 160, device)
    qc, sc, wc = fp8_weight(g, 200, 320, device)  # the two Ks' second matrix, with its own scale grid
    x, xg, x2 = act(g, 1, 320, scale=3.0).to(device), act(g, 1, 2 * 160).to(device), act(g, 1, 320).to(device)
    nw = (1 + 0.1 * torch.randn(320, generator=g)).to(BF16).to(device)
    xd = x.cpu().double()
    normed = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * nw.cpu().double()).to(BF16).double()
    xgd = xg.cpu().double()
    grouped = torch.cat([xgd[:, i * 160 : (i + 1) * 160] @ wg[i * 64 : (i + 1) * 64].T for i in (0, 1)], 1)

    def call(n, x=x, w=qa, s=sa, reduced=False, **kw):
        out = poisoned((1, n), torch.float32, device)
        if reduced:
            tiles = FP8.split_tiles(1, n, n, 640, kw["config"], split_k=2)
            kw["split_reduce"] = (poisoned((2 * n,), torch.float32, device),
                                  torch.zeros(tiles, dtype=torch.int32, device=device))  # fmt: skip
        FP8.fp8_gemv(x, w, s, out, **kw)
        return out.cpu()

    return [
        ("fma", call(200, config=FMA), xd @ wa.T),
        ("wide", call(200, config=WIDE), xd @ wa.T),
        ("two weights", call(272, w2=qb, w2_scale=sb, config=WIDE), xd @ torch.cat([wa, wb]).T),
        ("grouped", call(128, x=xg, w=qg, s=sg, group_rows=64, config=WIDE), grouped),
        ("normed", call(200, norm_w=nw, eps=1e-6, config=WIDE), normed @ wa.T),
        ("two Ks", call(200, w2=qc, w2_scale=sc, x2=x2, split_k=2, config=FMA, reduced=True),
         xd @ wa.T + x2.cpu().double() @ wc.T),
    ]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemv_batch1_paths(device):
    """Each batch-1 path of fp8_gemv (FMA and wide tiles, two weights, grouped, normed, two Ks)
    against float64: a scale row read for the wrong rows or blocks, or a tile's codes paired with
    another tile's columns, is an O(1) error."""
    for what, got, ref in _batch1_outputs(gen(1106), device):
        check(got, ref, f"fp8_gemv batch 1, {what}")


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
    # A reduced split's scratch: fp32 partials of split x B x N, int32 counts of every tile.
    partials, counts = torch.zeros(2 * 128), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(InputError, match="split_reduce partials"):
        FP8.fp8_gemv(x, q, s, out, split_k=2, split_reduce=(partials.half(), counts))
    with pytest.raises(InputError, match="split_reduce partials"):
        FP8.fp8_gemv(x, q, s, out, split_k=2, split_reduce=(partials[:100], counts))
    with pytest.raises(InputError, match="split_reduce arrivals"):
        FP8.fp8_gemv(x, q, s, out, split_k=2, split_reduce=(partials, counts[:0]))
    with pytest.raises(InputError, match="split_k"):  # K 128 in 3 parts: no whole tiles
        FP8.fp8_gemv(x, q, s, out, split_k=3, split_reduce=(torch.zeros(3 * 128), counts))
    with pytest.raises(InputError, match="fp32 partials"):  # an unreduced split writes fp32 [split, B, N]
        FP8.fp8_gemv(x, q, s, out, split_k=2)
    # W8A8 rounds the normed input: a prologue norm after the rounding would be other numerics
    with pytest.raises(InputError, match="act_fp8 with norm_w.*norm x first"):
        FP8.fp8_gemv(x, q, s, out, norm_w=torch.ones(128, dtype=BF16), eps=1e-6, act_fp8=True)
    with pytest.raises(InputError, match="split_reduce"):  # the bf16 GEMV has no reduced split
        FP8.project(x, torch.zeros(128, 128, dtype=BF16), out, config=FP8.DEFAULT, split_k=2,
                    split_reduce=(partials, counts))  # fmt: skip
    for fp8_only in ({"act_fp8": True}, {"fp8_config": FP8.DEFAULT}):  # FP8 options on a bf16 weight
        with pytest.raises(InputError, match=f"project on a bf16 weight.*{next(iter(fp8_only))}="):
            FP8.project(x, torch.zeros(128, 128, dtype=BF16), out, config=FP8.DEFAULT, **fp8_only)
    assert torch.equal(counts, torch.zeros_like(counts))  # no launch: nothing counted


# ---- moe_mxfp4 --------------------------------------------------------------------------------


class Experts:
    """Routed MXFP4 experts and an FP8 shared expert on ``device``, with their float64 dequantised copies."""

    def __init__(self, g, num_experts, d, inter, device):
        def mx(rows, cols):
            w = spread_weight(g, num_experts * rows, cols, (1, 32))  # a scale per 32-column run
            q, s = quantize_mxfp4(w)
            w64 = dequantize_mxfp4(q, s, torch.float64).view(num_experts, rows, cols)
            q, s = q.view(num_experts, rows, cols // 2), s.view(num_experts, rows, cols // 32)
            return q.to(device), s.to(device), w64

        self.w1, self.s1, self.w1_64 = mx(inter, d)
        self.w3, self.s3, self.w3_64 = mx(inter, d)
        self.w2, self.s2, self.w2_64 = mx(d, inter)
        sw1, sw2, sw3 = (fp8_weight(g, r, c, device) for r, c in ((inter, d), (d, inter), (inter, d)))
        self.shared = (sw1[0], sw1[1], sw2[0], sw2[1], sw3[0], sw3[1])
        self.shared_64 = (sw1[2], sw2[2], sw3[2])

    def routed(self):
        return self.w1, self.s1, self.w2, self.s2, self.w3, self.s3


def swiglu64(g, u, limit):
    g = g.clamp(max=limit)
    return g * torch.sigmoid(g) * u.clamp(-limit, limit)


def moe_reference(x, idx, wts, ex: Experts, limit, with_shared=True, round_act=False, merge_repeats=False):
    """float64: sum_k w2[e] (w_k * swiglu(w1[e] x, w3[e] x)) + shared; act rounded to bf16 if asked
    (the kernels round it, as the torch op does). ``merge_repeats``: a row's repeated expert once,
    with the weights summed (what the expert-major kernels compute; the same sum unrounded)."""
    x, idx, wts = x.cpu().double(), idx.cpu().long(), wts.cpu().double()
    if merge_repeats:
        wts = wts.clone()
        for b in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                first = (idx[b, :k] == idx[b, k]).nonzero()
                if first.numel():
                    wts[b, first[0, 0]] += wts[b, k]
                    wts[b, k] = 0.0
    rnd = (lambda a: a.to(BF16).double()) if round_act else (lambda a: a)
    out = torch.zeros(x.shape, dtype=torch.float64)
    gates = []
    for b in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[b, k]
            g = ex.w1_64[e] @ x[b]
            gates.append(g)
            out[b] += ex.w2_64[e] @ rnd(wts[b, k] * swiglu64(g, ex.w3_64[e] @ x[b], limit))
        if with_shared:
            sw1, sw2, sw3 = ex.shared_64
            out[b] += sw2 @ rnd(swiglu64(sw1 @ x[b], sw3 @ x[b], limit))
    return out, torch.cat(gates)


def routing(g, batch, top_k, num_experts, device):
    idx = torch.randint(0, num_experts, (batch, top_k), generator=g, dtype=torch.int32)
    idx[0, 1] = idx[0, 0]  # a row listing one expert twice
    if batch > 1:
        idx[1, 0] = idx[0, 0]  # another row sharing it
    wts = torch.rand(batch, top_k, generator=g) + 0.25
    return idx.to(device), (wts / wts.sum(1, keepdim=True) * 1.5).to(device)


D_SMALL, I_SMALL, E_SMALL, K_SMALL = 160, 96, 8, 3  # D, I: not multiples of 128 (ragged FP8 scale blocks)
LIMIT = 1.0  # small enough that the clamp is active on a good part of w1 x and w3 x


@pytest.fixture(scope="module")
def small_experts():
    return Experts(gen(2000), E_SMALL, D_SMALL, I_SMALL, "cpu")


def _experts_on(ex: Experts, device: str) -> Experts:
    if device == "cpu":
        return ex
    moved = Experts.__new__(Experts)
    moved.__dict__.update(ex.__dict__)
    for name in ("w1", "s1", "w2", "s2", "w3", "s3"):
        setattr(moved, name, getattr(ex, name).to(device))
    moved.shared = tuple(t.to(device) for t in ex.shared)
    return moved


MOE_DOT = (K["gemv"].GemvConfig(16, 64, 4, 2), K["gemv"].GemvConfig(16, 32, 4, 2))
# Batch 1, one K tile over all of D (the shared expert's: two FP8 scale blocks, the second partial).
MOE_WIDE = (K["gemv"].GemvConfig(8, 256, 4, 2, use_dot=False), K["gemv"].GemvConfig(8, 512, 4, 2, use_dot=False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "batch,grouped,variant",
    [
        (1, False, "fma"),
        (1, False, "wide"),
        (1, False, "dot"),
        (4, True, "dot"),
        (4, False, "dot"),
        (1, True, "dot"),
        (2, True, "mma"),  # 1 warp, 16 rows a program, 128-column K tiles (D, I: the last one ragged)
        (8, True, "mma_wide"),  # 8 rows: every batch column of the mma
        (5, True, "mma_wide"),  # 4 warps, 64 rows a program (ragged in I and D), 256-column K tiles
        (12, True, "mma_wide"),  # an expert 9 rows chose (forced below): a chunk of 16, two batch tiles
        (20, True, "mma_wide"),  # an expert 17 rows chose: a chunk of 16 and one of 1, side by side
        (5, True, "mma_whole"),  # w13's K in one part (the mma cases above: in two, "split K")
    ],
)
def test_moe_mxfp4(device, small_experts, batch, grouped, variant, monkeypatch):
    """Slot-major (FMA or dot), expert-major (dot, or tensor cores: moe_mxfp4_mma), repeated experts,
    the clamp active, poisoned out."""
    if device == "cpu" and batch in (8, 20):  # 20 s of CI each: the 12-row case runs what they run
        pytest.skip("the interpreter runs a full 8-column tile and two tiles in the 12-row case; the GPU runs all")
    if not variant.startswith("mma"):
        monkeypatch.setattr(MX, "MMA_MAX_BATCH", 0)
    else:
        wide = variant in ("mma_wide", "mma_whole")
        tile = K["gemv"].GemvConfig(64, 256, 4, 1) if wide else K["gemv"].GemvConfig(16, 128, 1, 1)
        monkeypatch.setattr(MX, "W13_CONFIG_MMA", tile)
        monkeypatch.setattr(MX, "W2_CONFIG_MMA", tile)
        monkeypatch.setattr(MX, "W13_SPLIT_MMA", 1 if variant == "mma_whole" else 2)
    if variant in ("dot", "wide"):
        configs = MOE_DOT if variant == "dot" else MOE_WIDE
        monkeypatch.setattr(MX, "W13_CONFIG", configs[0])
        monkeypatch.setattr(MX, "W2_CONFIG", configs[1])
    ex = _experts_on(small_experts, device)
    g = gen(2100 + batch)
    x = act(g, batch, D_SMALL).to(device)
    idx, wts = routing(g, batch, K_SMALL, E_SMALL, device)
    if batch > 8:
        idx[: 9 if batch <= 16 else 17, 2] = idx[0, 0]  # 9 or 17 rows share an expert (one of them twice)
    out = poisoned((batch, D_SMALL), BF16, device)
    MX.moe_mxfp4(x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT, shared=ex.shared, grouped=grouped)
    ref, gates = moe_reference(x, idx, wts, ex, LIMIT)
    clamped = (gates > LIMIT).double().mean().item()
    assert 0.05 < clamped < 0.95, f"the clamp should bite on part of w1 x: {clamped:.2f} above the limit"
    check(out.cpu(), ref, f"moe_mxfp4 B={batch} grouped={grouped} {variant}")


def _capped(scale: torch.Tensor, cap: int, first: int | None = None) -> torch.Tensor:
    """``scale``'s bytes capped at ``cap``, its first byte set to ``first`` (where given)."""
    capped = scale.view(torch.uint8).clamp(max=cap)
    if first is not None:
        capped.view(-1)[0] = first
    return capped.view(scale.dtype)


def _bumped(scale: torch.Tensor, byte: int) -> torch.Tensor:
    """``scale`` with its first byte set to ``byte``."""
    return _capped(scale, 255, byte)


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 [E, rows, cols] of stacked MXFP4 experts."""
    flat = dequantize_mxfp4(q.reshape(-1, q.shape[-1]).cpu(), s.reshape(-1, s.shape[-1]).cpu(), torch.float64)
    return flat.view(*q.shape[:-1], -1)


def test_w13_parts_follow_the_batch(monkeypatch):
    """w13's K in W13_SPLIT_MMA parts up to W13_SPLIT_LARGE_BATCH rows, W13_SPLIT_MMA_LARGE past it;
    never more parts than 128-column chunks of D, and none where the tensor-core kernels do not run."""
    monkeypatch.setattr(MX, "W13_SPLIT_MMA", 4)
    monkeypatch.setattr(MX, "W13_SPLIT_MMA_LARGE", 2)
    monkeypatch.setattr(MX, "W13_SPLIT_LARGE_BATCH", 32)
    tiles = 2048 // MX.W13_CONFIG_MMA.block_n
    assert MX.mma_split(32, 2048, 4096, BF16, True) == (4, tiles)
    assert MX.mma_split(33, 2048, 4096, BF16, True) == (2, tiles)
    assert MX.mma_split(64, 2048, 4096, BF16, True) == (2, tiles)
    assert MX.mma_split(8, 2048, 256, BF16, True) == (2, tiles)  # D of two 128-column chunks
    assert MX.mma_split(8, 2048, 4096, BF16, False) == (1, 0)  # slot-major: no tensor-core kernels
    assert MX.mma_split(MX.MMA_MAX_BATCH + 1, 2048, 4096, BF16, True) == (1, 0)


def test_rebias_fits_reads_every_scale_byte():
    """moe_mxfp4.rebias_fits: the one-multiply decode (moe_mxfp4_mma, "rebiased scale") only where
    every byte is at most 128 (2^(byte - 1) a bf16); a QuantWeight keeps its largest byte."""
    from draftgraph.runtime.model.quant import QuantWeight, quantize_weight

    s = torch.full((2, 4, 3), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert MX.rebias_fits(s) and MX.rebias_fits(_bumped(s, 128))
    assert not MX.rebias_fits(s, _bumped(s, 129)) and not MX.rebias_fits(_bumped(s, 255))
    w = quantize_weight(torch.randn(2, 8, 64), "mxfp4")
    assert w.max_scale_byte == int(w.scale.view(torch.uint8).max()) <= 128
    big = QuantWeight(w.data, _bumped(w.scale, 140), "mxfp4")
    assert big.max_scale_byte == 140 and "max_scale_byte" in vars(big)  # read once, kept


@cuda
@needs_cuda
@pytest.mark.parametrize("batch", [5, 12])
def test_moe_mxfp4_rebiased_decode_is_bit_exact(small_experts, batch, monkeypatch):
    """The tensor cores' one-multiply decode gives the two-multiply one's out bit for bit (a power
    of two times an exact code, one rounding either way), with block scales up to 2 (byte 128, its
    limit); a byte of 129 is refused it and the two multiplies stay right. (The small experts'
    spread scales reach past 128: capped here.)"""
    tile = K["gemv"].GemvConfig(64, 256, 4, 1)
    monkeypatch.setattr(MX, "W13_CONFIG_MMA", tile)
    monkeypatch.setattr(MX, "W2_CONFIG_MMA", tile)
    ex = _experts_on(small_experts, "cuda")
    g = gen(2300 + batch)
    x = act(g, batch, D_SMALL).cuda()
    idx, wts = routing(g, batch, K_SMALL, E_SMALL, "cuda")
    idx[:, 0] = 0  # every row reads expert 0, whose first block is set below
    w1, s1, w2, s2, w3, s3 = ex.routed()
    for first in (None, 128, 129):
        scales = [_capped(s, 128, first) for s in (s1, s2)] + [_capped(s3, 128)]
        fits = MX.rebias_fits(scales[0], scales[2]), MX.rebias_fits(scales[1])
        assert fits == ((first != 129),) * 2
        outs = []
        for rebias in ((False, False), fits):
            out = poisoned((batch, D_SMALL), BF16, "cuda")
            MX.moe_mxfp4(x, idx, wts, w1, scales[0], w2, scales[1], w3, scales[2], out, swiglu_limit=LIMIT,
                         shared=ex.shared, grouped=True, rebias=rebias)  # fmt: skip
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"first byte {first}: the decodes differ"
        capped = Experts.__new__(Experts)
        capped.__dict__.update(ex.__dict__)
        capped.w1_64, capped.w2_64, capped.w3_64 = (_dequantized(q, s) for q, s in zip((w1, w2, w3), scales))
        check(outs[1].cpu(), moe_reference(x, idx, wts, capped, LIMIT)[0], f"rebiased B={batch} first byte {first}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk,slots_of_19", [(8, 3), (16, 2)])
def test_expert_row_table_gives_each_chunk_of_rows_a_slot_of_its_own(device, chunk, slots_of_19):
    """moe_mxfp4_mma's table ("expert-row table") against a Python model: each expert's rows, in
    row order, cut into chunks of 8 (the mma's n) or, past 8 rows a batch, of 16 (note "chunks of
    16"), each chunk held by the first pair of its first row with the rows' act rows and summed
    weights; every other slot holds a count of 0. An expert 19 rows chose (one of them twice, in a
    later column) takes three slots of 8, or two of 16; a NO_EXPERT id heads nothing. And w13's
    arrival counts, every slot's and the shared expert's, are zeroed ("split K")."""
    from draftgraph.ops.triton import moe_mxfp4_mma as M

    b, top_k = 24, 4
    assert MX.mma_chunk_rows(b) == 16 and MX.mma_chunk_rows(8) == 8
    g = gen(77)
    idx = torch.randint(0, 40, (b, top_k), generator=g, dtype=torch.int32)
    idx[idx == 5] = 6
    idx[:19, 1] = 5
    idx[3, 3] = 5  # row 3 chose expert 5 twice: one row of its chunk, the weights summed
    idx[7, 2] = -1  # NO_EXPERT (a sharded rank's expert held elsewhere)
    wts = torch.rand(b, top_k, generator=g)
    count = torch.full((b * top_k,), -7, dtype=torch.int32)
    rows, dest = (torch.full((b * top_k, chunk), -7, dtype=torch.int32) for _ in range(2))
    wt = torch.full((b * top_k, chunk), float("nan"))
    tiles = 3  # w13's row tiles a slot: their arrival counts ("split K"), the shared slot's last
    arrivals = torch.full(((b * top_k + 1) * tiles,), -7, dtype=torch.int32)
    idx, wts, count, rows, dest, wt, arrivals = (t.to(device) for t in (idx, wts, count, rows, dest, wt, arrivals))
    M.launch_rows((b * top_k,), idx, wts, count, rows, dest, wt, arrivals, b, tiles, TOPK=top_k, TOPK_PAD=top_k,
                  BLOCK_R=32, NPID_PAD=4, CHUNK=chunk, num_warps=1, PDL=False)  # fmt: skip
    assert arrivals.cpu().tolist() == [0] * len(arrivals), "every tile's arrival count starts at 0"
    ids, weights = idx.cpu().tolist(), wts.cpu()
    want = {}
    for e in {i for r in ids for i in r} - {-1}:
        chose = [r for r in range(b) if e in ids[r]]
        for c in range(0, len(chose), chunk):
            part = chose[c : c + chunk]
            want[part[0] * top_k + ids[part[0]].index(e)] = [
                (r, r * top_k + ids[r].index(e), float(sum(weights[r, k] for k in range(top_k) if ids[r][k] == e)))
                for r in part
            ]
    assert len([s for s, held in want.items() if ids[s // top_k][s % top_k] == 5]) == slots_of_19
    count, rows, dest, wt = count.cpu(), rows.cpu(), dest.cpu(), wt.cpu()
    for s in range(b * top_k):
        held = want.get(s, [])
        n = len(held)
        assert int(count[s]) == n, f"slot {s}: {int(count[s])} rows, want {n}"
        assert rows[s, :n].tolist() == [r for r, _, _ in held]
        assert dest[s, :n].tolist() == [d for _, d, _ in held]
        assert torch.allclose(wt[s, :n], torch.tensor([w for _, _, w in held]), rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,grouped", [(1, False), (3, True)])
def test_moe_mxfp4_fp16_x_takes_the_dot_tiles(device, small_experts, batch, grouped):
    """The word kernels (batch 1, the mma ones) read x as bf16 pairs; fp16 x once went there too and
    was read as bf16 bits. It takes the dot tiles, and the result is the reference's."""
    ex = _experts_on(small_experts, device)
    g = gen(2300 + batch)
    x = act(g, batch, D_SMALL).to(torch.float16).to(device)
    idx, wts = routing(g, batch, K_SMALL, E_SMALL, device)
    out = poisoned((batch, D_SMALL), torch.float16, device)
    MX.moe_mxfp4(x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT, shared=ex.shared, grouped=grouped)
    check(out.cpu(), moe_reference(x, idx, wts, ex, LIMIT)[0], f"moe_mxfp4 fp16 x B={batch}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,grouped", [(1, False), (3, True)])
def test_moe_mxfp4_fp32_out_matches_rounded_act(device, small_experts, batch, grouped):
    """fp32 out against the reference that rounds act to bf16 as the kernel does: only summation order left."""
    ex = _experts_on(small_experts, device)
    g = gen(2200 + batch)
    x = act(g, batch, D_SMALL).to(device)
    idx, wts = routing(g, batch, K_SMALL, E_SMALL, device)
    out = poisoned((batch, D_SMALL), torch.float32, device)
    MX.moe_mxfp4(x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT, shared=ex.shared, grouped=grouped)
    ref, _ = moe_reference(x, idx, wts, ex, LIMIT, round_act=True, merge_repeats=grouped)
    err = rel_err(out.cpu(), ref)
    assert not torch.isnan(out).any() and err < 1e-5, f"moe_mxfp4 fp32 out: {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,grouped", [(1, False), (3, True)])
def test_moe_mxfp4_routed_only_accumulate_and_ids_read_on_device(device, small_experts, batch, grouped):
    """No shared expert, adding into out; then new ids written into the same idx tensor are the ones used."""
    ex = _experts_on(small_experts, device)
    g = gen(2300 + batch)
    x = act(g, batch, D_SMALL).to(device)
    idx, wts = routing(g, batch, K_SMALL, E_SMALL, device)
    base = act(g, batch, D_SMALL).to(device)
    for step in range(2):
        out = base.clone()
        MX.moe_mxfp4(x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT, accumulate=True, grouped=grouped)
        ref, _ = moe_reference(x, idx, wts, ex, LIMIT, with_shared=False)
        check(out.cpu(), base.cpu().double() + ref, f"moe_mxfp4 accumulate, step {step}")
        idx.copy_((idx + 1 + step) % E_SMALL)  # in place, as the route kernel writes it in a captured graph


def test_moe_mxfp4_rejects_bad_inputs(small_experts):
    ex, g = small_experts, gen(2400)
    x = act(g, 1, D_SMALL)
    idx, wts = routing(g, 1, K_SMALL, E_SMALL, "cpu")
    out = torch.empty(1, D_SMALL, dtype=BF16)
    w1, s1, w2, s2, w3, s3 = ex.routed()
    with pytest.raises(InputError, match="w1_scale"):
        MX.moe_mxfp4(x, idx, wts, w1, s1[:, :, :1], w2, s2, w3, s3, out, swiglu_limit=LIMIT)
    with pytest.raises(InputError, match="w2"):
        MX.moe_mxfp4(x, idx, wts, w1, s1, w2.transpose(1, 2), s2, w3, s3, out, swiglu_limit=LIMIT)
    with pytest.raises(InputError, match="sw2_scale"):
        bad = list(ex.shared)
        bad[3] = bad[1]
        MX.moe_mxfp4(x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT, shared=tuple(bad))
    # rebias: the decode each matrix takes (moe_mxfp4_mma, "rebiased scale"), a pair of bools or None.
    for bad in (True, (True,), (1, 0), [True, True], (True, None)):
        with pytest.raises(InputError, match="rebias.*None or \\(bool, bool\\)"):
            MX.moe_mxfp4(x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT, rebias=bad)
    # The word kernels read x and the codes as int32, batch 1 16 bytes at a time: a start off those
    # boundaries is refused before any launch (4-byte aligned x is not enough at batch 1).
    for offset in (1, 4):
        shifted_x = act(g, 1, D_SMALL + offset)[:, offset:]
        with pytest.raises(InputError, match="x layout.*16-byte aligned"):
            MX.moe_mxfp4(shifted_x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT)
    for offset in (1, 4):
        shifted = torch.empty(w1.numel() + offset, dtype=w1.dtype)[offset:].view(w1.shape)
        shifted.copy_(w1)
        with pytest.raises(InputError, match="w1 start.*16-byte aligned"):
            MX.moe_mxfp4(x, idx, wts, shifted, s1, w2, s2, w3, s3, out, swiglu_limit=LIMIT)
    # The mma kernels' tiles: 16 rows a warp, whole 128-column chunks (a knob set by hand or a tuner).
    x3, (idx3, wts3), out3 = act(g, 3, D_SMALL), routing(g, 3, K_SMALL, E_SMALL, "cpu"), torch.empty(3, D_SMALL,
                                                                                                    dtype=BF16)
    for tile in (K["gemv"].GemvConfig(8, 256, 1, 1), K["gemv"].GemvConfig(16, 64, 1, 1)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(MX, "W2_CONFIG_MMA", tile)
            with pytest.raises(InputError, match="W2_CONFIG_MMA.*multiple of 16"):
                MX.moe_mxfp4(x3, idx3, wts3, *ex.routed(), out3, swiglu_limit=LIMIT)
    # Batch 1's w2 reads the act rows carved from the workspace 16 bytes at a time too.
    nbytes = MX.moe_mxfp4_workspace(1, K_SMALL, I_SMALL, D_SMALL, BF16, False, shared=False)
    off = torch.zeros(nbytes + 8, dtype=torch.uint8)[8:]
    out.fill_(7.0)
    with pytest.raises(InputError, match="workspace alignment.*16 bytes"):
        MX.moe_mxfp4(x, idx, wts, *ex.routed(), out, swiglu_limit=LIMIT, workspace=off)
    assert bool((out == 7.0).all()) and not bool(off.any())  # refused before any launch


# ---- the V4-Flash shapes, on the GPU (run on an H200 since 2026-12-05: benchmarks/h200) ----

FLASH = V4Config.flash()


def _flash_fp8_cases():
    """name -> (rows of x per batch row, [(N, K)] of the weights, x columns, gemv options): the FP8 linears."""
    c = FLASH
    d, hd, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.moe_intermediate_size
    group_cols = hd // c.o_groups
    return {
        "e_proj": (1, [(d, d)], d, {}),
        "h_proj": (c.hc_mult, [(d, d)], d, {}),  # streams mode: one row per stream
        "wq_a+wkv": (1, [(c.q_lora_rank, d), (c.head_dim, d)], d, {}),
        "wq_b": (1, [(hd, c.q_lora_rank)], c.q_lora_rank, {"norm": True}),
        "wo_a": (1, [(c.o_groups * c.o_lora_rank, group_cols)], hd, {"group_rows": c.o_lora_rank}),
        "wo_b": (1, [(d, c.o_groups * c.o_lora_rank)], c.o_groups * c.o_lora_rank, {}),
        "shared.w1": (1, [(inter, d)], d, {}),
        "shared.w2": (1, [(d, inter)], inter, {"accumulate": True}),
    }


def _cuda_fp8(rows, cols, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(rows, cols, device="cuda", generator=g) / math.sqrt(cols)
    q, s = quantize_fp8(w)
    return q, s, dequantize_fp8(q, s, torch.float64)


@cuda
@needs_cuda
@pytest.mark.parametrize("name", sorted(_flash_fp8_cases()))
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("native", [False, True])
def test_flash_fp8_gemv(name, batch, native):
    if native and not FP8.native_fp8_supported(torch.device("cuda")):
        pytest.skip("no native e4m3 conversion on this GPU")
    rows_per, shapes, x_cols, opts = _flash_fp8_cases()[name]
    rows = batch * rows_per
    if rows > 64:
        pytest.skip("skinny GEMMs are for at most 64 rows")
    weights = [_cuda_fp8(n, k, 3000 + i) for i, (n, k) in enumerate(shapes)]
    x = (torch.randn(rows, x_cols, device="cuda") + 0.05).to(BF16)
    xd = x.double()
    kwargs, ref_x = {}, xd
    if opts.get("norm"):
        nw = (1 + 0.1 * torch.randn(x_cols, device="cuda")).to(BF16)
        kwargs.update(norm_w=nw, eps=FLASH.rms_norm_eps)
        ref_x = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + FLASH.rms_norm_eps) * nw.double()).to(BF16).double()
    if len(weights) == 2:
        kwargs.update(w2=weights[1][0], w2_scale=weights[1][1])
    w64 = torch.cat([w[2] for w in weights])
    n = w64.shape[0]
    if opts.get("group_rows"):
        gr, gc = opts["group_rows"], shapes[0][1]
        kwargs["group_rows"] = gr
        ref = torch.cat([ref_x[:, i * gc : (i + 1) * gc] @ w64[i * gr : (i + 1) * gr].T for i in range(n // gr)], 1)
    else:
        ref = ref_x @ w64.T
    out = torch.full((rows, n), float("nan"), dtype=BF16, device="cuda")
    if opts.get("accumulate"):
        out = (torch.randn(rows, n, device="cuda")).to(BF16)
        ref = ref + out.double()
        kwargs["accumulate"] = True
    config = FP8.config_for(rows)
    FP8.fp8_gemv(x, weights[0][0], weights[0][1], out, config=config, native_fp8=native, **kwargs)
    check(out, ref, f"{name} B={rows} native={native}")


@pytest.fixture(scope="module")
def flash_mx_experts():
    """256 MXFP4 experts (random codes, scales 2^-8 .. 2^-6: 3.2 GB) and the FP8 shared expert."""
    d, e, i = FLASH.hidden_size, FLASH.n_routed_experts, FLASH.moe_intermediate_size
    g = torch.Generator(device="cuda").manual_seed(11)

    def mx(rows, cols):
        codes = torch.randint(0, 256, (e, rows, cols // 2), device="cuda", generator=g, dtype=torch.uint8)
        scales = torch.randint(119, 122, (e, rows, cols // 32), device="cuda", generator=g, dtype=torch.uint8)
        return codes.view(torch.int8), scales.view(torch.float8_e8m0fnu)

    w1, w3, w2 = mx(i, d), mx(i, d), mx(d, i)
    sw1, sw2, sw3 = _cuda_fp8(i, d, 21), _cuda_fp8(d, i, 22), _cuda_fp8(i, d, 23)
    yield (w1, w2, w3), (sw1, sw2, sw3)
    torch.cuda.empty_cache()


def _flash_moe_reference(x, idx, wts, experts, shared):
    (w1, w2, w3), (sw1, sw2, sw3) = experts, shared
    limit, cache = FLASH.swiglu_limit, {}

    def expert(e):
        if e not in cache:
            cache.clear()  # one expert's float64 copies at a time (200 MB)
            cache[e] = [dequantize_mxfp4(w[0][e], w[1][e], torch.float64) for w in (w1, w2, w3)]
        return cache[e]

    xd, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device="cuda")
    order = sorted((int(idx[b, k]), b, k) for b in range(idx.shape[0]) for k in range(idx.shape[1]))
    for e, b, k in order:
        d1, d2, d3 = expert(e)
        out[b] += d2 @ (float(wts[b, k]) * swiglu64(d1 @ xd[b], d3 @ xd[b], limit))
    out += (swiglu64(xd @ sw1[2].T, xd @ sw3[2].T, limit)) @ sw2[2].T
    return out


def _flash_routing(batch):
    e, k = FLASH.n_routed_experts, FLASH.num_experts_per_tok
    idx = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(batch)]).to(torch.int32)
    if batch > 1:
        idx[1] = idx[0]  # two rows with the same experts
        idx[min(2, batch - 1), :2] = idx[0, 0]  # a row listing one expert twice
    wts = torch.rand(batch, k, device="cuda") + 0.25
    return idx, wts / wts.sum(1, keepdim=True) * FLASH.routed_scaling_factor


@cuda
@needs_cuda
@pytest.mark.parametrize("batch,grouped", [(1, False), (1, True), (8, True), (8, False), (32, True), (64, True)])
def test_flash_moe_mxfp4(flash_mx_experts, batch, grouped):
    experts, shared = flash_mx_experts
    (w1, w2, w3), (sw1, sw2, sw3) = experts, shared
    x = (torch.randn(batch, FLASH.hidden_size, device="cuda") * 2).to(BF16)
    idx, wts = _flash_routing(batch)
    out = torch.full(x.shape, float("nan"), dtype=BF16, device="cuda")
    shared_q = (sw1[0], sw1[1], sw2[0], sw2[1], sw3[0], sw3[1])
    MX.moe_mxfp4(x, idx, wts, w1[0], w1[1], w2[0], w2[1], w3[0], w3[1], out,
                 swiglu_limit=FLASH.swiglu_limit, shared=shared_q, grouped=grouped)  # fmt: skip
    check(out, _flash_moe_reference(x, idx, wts, experts, shared), f"flash moe_mxfp4 B={batch} grouped={grouped}")


@cuda
@needs_cuda
@pytest.mark.parametrize("batch", [1, 8])
def test_flash_moe_mxfp4_captured_replay_reads_new_ids(flash_mx_experts, batch):
    """Captured once; new expert ids and x written in place; the replay equals an eager call bit for bit."""
    experts, shared = flash_mx_experts
    (w1, w2, w3), (sw1, sw2, sw3) = experts, shared
    shared_q = (sw1[0], sw1[1], sw2[0], sw2[1], sw3[0], sw3[1])
    x = (torch.randn(batch, FLASH.hidden_size, device="cuda")).to(BF16)
    idx, wts = _flash_routing(batch)
    out = torch.empty_like(x)
    ws = torch.empty(MX.moe_mxfp4_workspace(batch, idx.shape[1], w1[0].shape[1], x.shape[1], x.dtype, batch > 1),
                     dtype=torch.uint8, device="cuda")  # fmt: skip

    def call(o):
        MX.moe_mxfp4(x, idx, wts, w1[0], w1[1], w2[0], w2[1], w3[0], w3[1], o,
                     swiglu_limit=FLASH.swiglu_limit, shared=shared_q, workspace=ws)  # fmt: skip

    call(out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    new_idx, new_wts = _flash_routing(batch)
    idx.copy_(new_idx)
    wts.copy_(new_wts)
    x.copy_(torch.randn_like(x, dtype=torch.float32).to(BF16))
    graph.replay()
    eager = torch.empty_like(out)
    call(eager)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# ---- W8A8: fp8_gemv's act_fp8 (note "W8A8 on the tensor cores") --------------------------------
WGMMA = K["gemv"].GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)  # FP8 x FP8 on wgmma


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["plain", "two_w", "grouped", "accumulate", "split"])
def test_fp8_gemv_act_fp8_is_the_gemv_of_the_rounded_activations(device, variant):
    """act_fp8 = the GEMV of x rounded through FP8 per 1 x 128 run (runtime.model.quant's
    rounding). Under the interpreter (no FP8 dot) by that rounding and the bf16 tiles: bit-equal to
    them; compiled, on the FP8 tensor cores (the path asserted taken) against the float64 product of
    the rounded activations, at 6 rows and at 40 (two row blocks of the 64-row tiles). Hopper's FP8
    MMA keeps fewer accumulator bits than fp32 inside a 128-column block (DeepSeek-V3's report, 3.3.2),
    so the compiled limit is 5e-4, not fp32's 2e-5."""
    g = gen(1201)
    q, s, w = fp8_weight(g, 256, 512, device)
    q2, s2, w2 = fp8_weight(g, 128, 512, device)
    cases = [(6, DOT)] if device == "cpu" else [(6, WGMMA), (6, FP8.config_for(6)), (40, WGMMA)]
    for rows, cfg in cases:
        x = act(g, rows, 512, scale=3.0).to(device)
        xr = fp8_round_activations(x)
        xd = xr.cpu().double()
        wq, ws, kw, ref, k = q, s, {}, xd @ w.T, 512
        if variant == "two_w":
            kw, ref = dict(w2=q2, w2_scale=s2), xd @ torch.cat([w, w2]).T
        elif variant == "grouped":  # 2 groups of 128 rows, 256 columns of x each
            wq, ws, kw, k = q[:, :256].contiguous(), s[:, :2].contiguous(), dict(group_rows=128), 256
            ref = torch.cat([xd[:, i * 256 : (i + 1) * 256] @ w[i * 128 : (i + 1) * 128, :256].T for i in range(2)], 1)
        n = ref.shape[1]
        start = poisoned((rows, n), torch.float32, device)
        if variant == "accumulate":
            start = act(g, rows, n).float().to(device)
            ref = ref + start.cpu().double()
            kw["accumulate"] = True
        if variant == "split":
            tiles = FP8.split_tiles(rows, n, n, k, cfg, split_k=2)
            kw.update(split_k=2, split_reduce=(poisoned((2 * rows * n,), torch.float32, device),
                                               torch.zeros(tiles, dtype=torch.int32, device=device)))
        if device == "cuda":
            native = FP8.native_fp8_supported(x.device)
            assert FP8.act_fp8_fits(cfg, 128, True, native, None) == native, (rows, cfg)
        out = start.clone()
        FP8.fp8_gemv(x, wq, ws, out, config=cfg, act_fp8=True, **kw)
        what = f"fp8_gemv act_fp8 {variant} B={rows} {cfg}"
        assert not torch.isnan(out).any(), f"{what}: unwritten (NaN) elements"
        err = rel_err(out.cpu(), ref)
        assert err < (2e-5 if device == "cpu" else 5e-4), f"{what}: relative error {err:.2e}"
        if device == "cpu":
            want = start.clone()
            FP8.fp8_gemv(xr, wq, ws, want, config=cfg, **kw)
            assert torch.equal(out, want), f"{what}: not the bf16 GEMV of the rounded activations"


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemv_act_fp8_rounds_each_group_apart(device):
    """Grouped (wo_a), each group's K columns are 1 x 128 runs of their own, as the reference rounds
    o per group: with a group K of 192 the runs of the whole row would straddle the groups. Group 0
    is scaled 2^12 down, so rounding across the boundary would change its values."""
    g = gen(1203)
    q, s, w = fp8_weight(g, 2 * 64, 192, device)  # 2 groups of 64 rows, 192 columns of x each
    x = act(g, 5, 2 * 192, scale=3.0)
    x[:, :192] = (x[:, :192].double() * 2.0**-12).to(BF16)
    per_group = fp8_round_activations(x.view(5, 2, 192)).view(5, -1)
    assert not torch.equal(per_group, fp8_round_activations(x))  # the case tells the two apart
    xd = per_group.double()
    ref = torch.cat([xd[:, i * 192 : (i + 1) * 192] @ w[i * 64 : (i + 1) * 64].T for i in range(2)], 1)
    out = poisoned((5, 128), torch.float32, device)
    FP8.fp8_gemv(x.to(device), q, s, out, group_rows=64, config=DOT, act_fp8=True)
    for i in range(2):  # each group against its own norm: group 0's outputs are 2^12 smaller
        check(out[:, i * 64 : (i + 1) * 64].cpu(), ref[:, i * 64 : (i + 1) * 64], f"act_fp8 grouped, group {i}")
    # ragged runs take the rounding and the bf16 tiles on either device: the GEMV of per_group itself
    want = poisoned((5, 128), torch.float32, device)
    FP8.fp8_gemv(per_group.to(device), q, s, want, group_rows=64, config=DOT)
    assert torch.equal(out, want)


@triton.jit
def _act_round_kernel(x_ptr, out_ptr):
    at = tl.arange(0, 16)[:, None] * 128 + tl.arange(0, 128)[None, :]
    q, scale = FP8.act_fp8_block(tl.load(x_ptr + at))
    tl.store(out_ptr + at, q.to(tl.float32) * scale[:, None])


@cuda
@needs_cuda
def test_act_fp8_block_rounds_as_the_torch_rounding():
    """The kernel's own rounding of an activation tile (act_fp8_block: the scale from the bits, the
    codes by the hardware's round-to-nearest-even) gives fp8_round_activations' values bit for bit,
    on rows of magnitudes 2^-30 .. 2^30, a zero row (the amax floor), the saturation edge and ties."""
    if not FP8.native_fp8_supported(torch.device("cuda")):
        pytest.skip("no native e4m3 conversion on this GPU")
    g = gen(1202)
    x = torch.randn(16, 128, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 31, (16, 1), generator=g).double())
    x[3] = 0.0
    x[4, :8] = torch.tensor([448.0, 464.0, 480.0, 416.0, 432.0, -448.0, 1e-3, 0.0], dtype=torch.float64)
    x = x.to(BF16)
    out = torch.full((16, 128), float("nan"), device="cuda")
    _act_round_kernel[(1,)](x.cuda(), out)
    want = fp8_round_activations(x).float()
    assert torch.equal(out.cpu(), want), (out.cpu() - want).abs().max()
