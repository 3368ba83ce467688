"""FP8 block-scaled GEMV / skinny GEMM: out[B, N] = x[B, K] @ dequant(W)[N, K]^T, B <= 64.

W is ``float8_e4m3fn`` [N, K] with one UE8M0 scale per 128 x 128 tile, ``[ceil(N/128),
ceil(K/128)]`` (``runtime/model/quant.py``; edge tiles may be partial). The kernel is
``gemv.py``'s with the weight read as bytes: half the bf16 bytes, the same tiling.

Note "dequantised in registers": a dot tile [BLOCK_N, BLOCK_K] never straddles a scale column
(BLOCK_K divides 128), so each of its rows has one scale. The codes are decoded to fp32
(exact: e4m3 is a subset of bf16 and of fp32), multiplied by x in the dot, and the row's scale
multiplies the tile's partial product, not each weight: a power of two, so
``(q . x) * s == (q * s) . x`` exactly in fp32 (no overflow at these magnitudes). Nothing is
dequantised to memory.

Note "wide tiles": the FMA variant (batch 1) reads [BLOCK_N, NBK, SUB_K] tiles, NBK scale
blocks of SUB_K = min(BLOCK_K, 128) columns, each code times its block's scale before the FMA.
A GEMV at batch 1 is bound by the bytes in flight, not by arithmetic: one program's loads are
one tile, issued together, and a 64 x 128 tile (8 KB) on 64 programs kept a 4096 x 4096 FP8
linear at 18% of copy bandwidth on an H200. The bf16 GEMV's winners are narrow and long
(8 x 1024, ``gemv.LINEAR_CONFIG``); wide tiles give the FP8 one the same shape.

Note "decode": the CPU interpreter has no float8 loads, so the weight is passed as uint8 and
decoded with integer ops (:func:`e4m3_to_f32`); scales always are (:func:`ue8m0_to_f32`: the
byte shifted into an fp32 exponent, so 2^(byte-127) exactly with no exp2). On a GPU with
native e4m3 conversion (sm89+, ``native_fp8``) the codes are loaded as fp8 and converted by
the hardware instead; the CPU tests run the integer decode, the CUDA tests both.

Note "split K, reduced": a GEMV of few output tiles (1536 rows are 48 programs of the 32-row dot
tiles; a 4096-row one 128, about one an SM) keeps too few bytes in flight to fill the memory
system. ``split_reduce`` cuts K into ``split_k`` programs a tile; each stores its fp32 partials,
counts its arrival (``last_to_arrive``), and the last of the tile to finish sums the parts in part
order (deterministic whichever comes last) and stores the output. The caller gives the partials'
scratch and the counts, zeroed by an earlier launch of the same op (kv finish in swa_attention;
other ops overwrite scratch between launches), and the last part resets its tile's count: no
launch is added and a launch repeated alone stays correct.

Note "two Ks": the combiner's out = h_proj(h) + e_proj(e), e's row broadcast over the C streams
of its batch row, as one launch: W2 (e_proj) continues W's K with its own activation rows (x2,
row r // x2_row_div). The parts of the split lie each in one matrix (split_k even), so a program
only picks its matrix, scales and rows at the start; the last part sums both (fp32, one rounding).

Note "aligned rows": where a program's matrix, scale grid and activation rows are picked at run
time (TWO_W's second matrix, CAT_K's second K), Triton loses the weight pointers' 16-byte
alignment: 3.6 (torch 2.11's) where they come out of ``if`` branches, 3.9 where they come out of
``tl.where``. The tiles were then read a byte a load (``LDG.E.U8``), the dot tiles outside the
cp.async pipeline, each K step waiting out a DRAM latency (ncu, the combiner's GEMV at B=1 on an
H100 under 3.6: 31.7 us at 33% of DRAM, a third of its warp samples on the byte stores into shared
memory, waiting for their loads). The tile pointers carry the alignment as hints
(``tl.multiple_of`` / ``tl.max_contiguous``) where the host has checked it (``ALIGNED_W``: rows
16-byte aligned, K a multiple of 16); tests/test_kernels_compile_for_the_gpu.py checks the PTX
of each variant.

Note "W8A8 on the tensor cores": with ``act_fp8`` (the reference's numerics: every FP8 linear's
input rounded through e4m3 per 1 x 128 run, runtime/model/quant.py's ``fp8_round_activations``)
the dot tiles need no decode at all: each K step loads the weight codes as they are, rounds the
activation tile's rows to e4m3 codes and a power-of-two scale each (``act_fp8_block``: the same
scale and round-to-nearest-even as the torch function, so bit-equal codes), and multiplies codes
by codes on the FP8 tensor cores, fp32 accumulation over the 128 columns of one scale block, then
times the weight row's and the activation row's scales (a product of powers of two: exact). The
sum over blocks is fp32 in registers, as DeepSeek's own FP8 GEMM promotes its partial sums every
128 columns. The decode the bf16 dot tiles spend most of their instructions on (a third of the
loop's PTX is the e4m3 -> fp32 -> bf16 conversion) is gone; an activation tile of B rows is
rounded in each program that reads it (B x 128 values a K step). Measured alone on an H100
(benchmarks/bench_w8a8_gemv.py, benchmarks/h200/KERNEL_RUNS.md, "Seventeenth device runs") it pays only where N
is large: wq_b (32768 x 1024) on 128-row tiles, 14.4 us at 32 rows against 26.6 for the bf16 tiles
on rounded activations, which the attention's W8A8 path takes from 8 rows; the N <= 4096 linears
are slower this way (too few tiles), and the 32-row default tiles (mma.sync on converted codes,
the rounding repeated in every N tile) slowest.

Variants and options as ``gemv.gemv``: dot (any batch, activations padded to 16 rows) or FMA
(batch 1), ``PRO_NORM``, ``GROUPED`` (wo_a), ``TWO_W`` (wq_a + wkv: the second matrix has its
own scale grid), ``SPLIT_K``, plus ``ACCUMULATE`` (out += x @ W^T: a residual, or the sum of
e_proj and h_proj into one buffer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.triton._common import (
    batch_block,
    interpreting,
    last_to_arrive,
    mma,
    next_pow2,
    pdl_args,
    pdl_wait,
    rows_aligned,
    tile_pointers,
)
from draftgraph.ops.triton.fp8_round import fp8_round_rows, pow2, run_exponents
from draftgraph.ops.triton.gemv import GemvConfig, gemv
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.model.quant import FP8_BLOCK, QuantWeight, fp8_scale_shape

# Batch 1: an FMA tile 4 rows x 1024 columns (eight scale blocks), one warp: narrow and long, as
# the bf16 GEMV's winners (see "wide tiles"). Tuned on one H200 at the 4096 x 4096 linear
# (`bench_kernels.py --weights native --tune`, benchmarks/h200/bench_kernels_native_tuned_bbbd33f.txt):
# 7.0 us, 57% of copy bandwidth (8 x 1024 on 4 warps the same; 16 x 512 9.0), where the best
# 128-column tile ran 21.8 (b93df2d). Batch > 1: the dot path, 32 x 128 on 4 warps with 6 stages
# in flight: at batch 4, 10.6 us against 11.5 with 4 stages on an H200, 10.8 against 11.7 on an
# H100 (the tuner's choice on both, benchmarks/h200/bench_kernels_native_tuned_73f0f53.txt and
# _a9be17b_h100.txt; 8 stages and 16- or 64-row tiles slower).
DEFAULT = GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=6)
BATCH1_CONFIG = GemvConfig(block_n=4, block_k=1024, num_warps=1, num_stages=3, use_dot=False)
# More than 16 rows (a dot tile of 32 or 64 activation rows: a serving batch, or the combiner's
# B x 4 stream rows from B=5 on) is a load of its own: twice the activation bytes a weight tile,
# and a chain at B=32 spent 306 us in these GEMVs for 140 MB (profile_native_e901c32.txt). Its
# own knob, tuned at B=32 (bench_kernels' linear:32 job): the same tile won there on both cards,
# by less (13.4 us against 13.6 / 13.7 with 4 stages; 31% of copy on the H200).
LARGE_BATCH_CONFIG = GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=6)
# More than 16 rows on a launch whose grid stays full on 64-row tiles (at least
# WIDE_GRID_PROGRAMS programs: output tiles x batch blocks x K parts): the 64-row tile, 3 stages,
# reads each activation tile for twice the weight rows. Measured in the chain at B=32 on an H100,
# one launch's tiles changed at a time against LARGE_BATCH_CONFIG: wo_a -11.0 us, wq_b -8.7, wo_b
# -2.2, the combiner's h_proj on 128 rows -0.9; this rule against the old one 0.878 -> 0.856 ms,
# B=8 and B=1 unchanged. The launches it leaves on 32-row tiles lose on 64 (e_proj 4096 x 4096 on
# 32 rows, 64 programs: 12.8 -> 16.5 us timed alone). At B <= 16 no launch moved the chain past its
# noise (B=8: all on 64- or 128-row tiles +4.6 us). benchmarks/h200/gemv_grid_tiles_69dfdf6_h100_log.txt,
# config_for_wide_ab_4798eb7_h100_log.txt.
WIDE_GRID_CONFIG = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)
WIDE_GRID_PROGRAMS = 128


def config_for(rows: int, n: int = 0, split_k: int = 1) -> GemvConfig:
    """The tile config of a GEMV over ``rows`` activation rows into ``n`` outputs (0: unknown) in
    ``split_k`` K parts (read at call time: tuners set the knobs)."""
    if rows == 1:
        return BATCH1_CONFIG
    if rows <= 16:
        return DEFAULT
    programs = triton.cdiv(n, WIDE_GRID_CONFIG.block_n) * triton.cdiv(rows, batch_block(rows)) * split_k
    return WIDE_GRID_CONFIG if programs >= WIDE_GRID_PROGRAMS else LARGE_BATCH_CONFIG


# ---- decoding bytes in registers ------------------------------------------------------------


@triton.jit
def e4m3_to_f32(q):
    """e4m3 bytes (uint8) -> fp32, exactly: sign, 4-bit exponent (bias 7), 3-bit mantissa; 0x7F/0xFF NaN."""
    b = q.to(tl.uint32)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = (((b & 0x80) << 24) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    # Exponent 0: man * 2^-9, its sign put in by bits (a negation compiles to 0 - x on the GPU,
    # which turns the code 0x80 into +0 where torch gives -0).
    sub = (man.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True) | ((b & 0x80) << 24)
    v = tl.where(exp == 0, sub.to(tl.float32, bitcast=True), normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def ue8m0_to_f32(s):
    """UE8M0 bytes (uint8) -> 2^(byte - 127) in fp32, exactly (byte 0: the subnormal 2^-127; 255: NaN)."""
    b = s.to(tl.uint32)
    bits = tl.where(b == 0, (b + 1) << 22, b << 23)
    bits = bits | ((b == 255).to(tl.uint32) << 22)  # 0x7F800000 (inf) -> 0x7FC00000 (NaN)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def codes_f32(q, NATIVE: tl.constexpr):
    """e4m3 codes -> fp32: the hardware conversion of fp8 loads (NATIVE), else the integer decode of bytes."""
    if NATIVE:
        return q.to(tl.float32)
    else:
        return e4m3_to_f32(q)


@triton.jit
def fp8_tile(w_rows, s_rows, kk, k0, n_mask, K, EVEN: tl.constexpr, NATIVE: tl.constexpr,
             ALIGNED: tl.constexpr = False):  # fmt: skip
    """(codes [BLOCK_N, BLOCK_K] in fp32, the rows' block scales [BLOCK_N]) of the K tile at k0.

    w_rows: [BLOCK_N, 1] pointers to the rows' first byte; s_rows: [BLOCK_N] pointers to the
    rows' scale-grid rows. The tile must lie in one 128-column scale block.
    """
    ptrs = tile_pointers(w_rows, kk, ALIGNED)  # note "aligned rows"
    if EVEN:
        q = tl.load(ptrs)
    else:
        # No `other`: compiled Triton casts no integer to fp8e4nv (the interpreter does); the
        # masked lanes are zeroed after the decode instead.
        live = n_mask[:, None] & (kk < K)[None, :]
        q = tl.load(ptrs, mask=live)
    v = codes_f32(q, NATIVE)
    if not EVEN:
        v = tl.where(live, v, 0.0)
    s = ue8m0_to_f32(tl.load(s_rows + k0 // 128, mask=n_mask, other=127))
    return v, s


@triton.jit
def fp8_tile3(w_rows, s_rows, k0, n_mask, K, NBK: tl.constexpr, SUB_K: tl.constexpr, EVEN: tl.constexpr,
              NATIVE: tl.constexpr, ALIGNED: tl.constexpr = False):  # fmt: skip
    """(codes [BLOCK_N, NBK, SUB_K] in fp32, their scales [BLOCK_N, NBK]) of the K tile at k0 (see "wide tiles").

    w_rows: [BLOCK_N] pointers to the rows' first byte; s_rows: [BLOCK_N] pointers to the rows'
    scale-grid rows. SUB_K divides 128 (NBK 1) or is 128.
    """
    cols = k0 + tl.arange(0, NBK)[:, None] * SUB_K + tl.arange(0, SUB_K)[None, :]  # [NBK, SUB_K]
    blocks = (k0 + tl.arange(0, NBK) * SUB_K) // 128
    ptrs = w_rows[:, None, None] + cols[None, :, :]
    if ALIGNED:  # note "aligned rows"
        ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 16, 16]), [1, 1, 16])
    if EVEN:
        q = tl.load(ptrs)
        s = tl.load(s_rows[:, None] + blocks[None, :])
    else:
        live = n_mask[:, None, None] & (cols < K)[None, :, :]
        q = tl.load(ptrs, mask=live)  # no `other`: see fp8_tile
        s = tl.load(s_rows[:, None] + blocks[None, :], mask=n_mask[:, None] & (blocks * 128 < K)[None, :], other=127)
    v = codes_f32(q, NATIVE)
    if not EVEN:
        v = tl.where(live, v, 0.0)
    return v, ue8m0_to_f32(s)


@triton.jit
def fp8_codes_tile(w_rows, s_rows, kk, k0, ALIGNED: tl.constexpr = False):
    """(codes [BLOCK_N, BLOCK_K] as loaded, fp8, the rows' block scales [BLOCK_N] in fp32): fp8_tile
    without the decode, for the FP8 x FP8 dot (note "W8A8 on the tensor cores"): fp8 loads of whole
    tiles only (no mask: compiled Triton casts no `other` to fp8, and a masked code left undefined
    could be a NaN times a zero activation)."""
    q = tl.load(tile_pointers(w_rows, kk, ALIGNED))
    s = ue8m0_to_f32(tl.load(s_rows + k0 // 128))
    return q, s


@triton.jit
def act_fp8_block(xv):
    """x [BLOCK_B, 128] -> (e4m3 codes, the rows' power-of-two scales [BLOCK_B]): runtime.model.quant's
    fp8_round_activations on one 128-column run, the scale 2^ceil(log2(max(amax, 1e-4) / 448)) made
    from the bits (no log2 / exp2 rounding), the codes by the hardware's round-to-nearest-even."""
    e = run_exponents(xv.to(tl.float32))
    q = (xv.to(tl.float32) * pow2(254 - e)[:, None]).to(tl.float8e4nv)  # x / 2^(e - 127): exact
    return q, pow2(e)


@triton.jit
def _accumulate(acc, v, s, x_rows, nw_ptr, inv, kk, row_mask, K, PRO_NORM: tl.constexpr, INTERP: tl.constexpr):
    """acc += (codes x activation columns) * row scale (the activation normed first under PRO_NORM): the dot path."""
    xv = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
    if PRO_NORM:
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * inv[:, None] * nw[None, :]).to(xv.dtype)  # rounded as the bf16 norm is
    xt = tl.trans(xv)
    return acc + mma(v.to(xt.dtype), xt, INTERP) * s[:, None]


@triton.jit
def _dot_tile(w_rows, s_rows, kk, k0, n_mask, K, EVEN: tl.constexpr, NATIVE: tl.constexpr, ALIGNED: tl.constexpr,
              ACT_FP8: tl.constexpr):  # fmt: skip
    """The dot path's weight tile: decoded (fp8_tile), or the codes as loaded under ACT_FP8."""
    if ACT_FP8:
        return fp8_codes_tile(w_rows, s_rows, kk, k0, ALIGNED)
    else:
        return fp8_tile(w_rows, s_rows, kk, k0, n_mask, K, EVEN, NATIVE, ALIGNED)


@triton.jit
def _dot_accumulate(acc, v, s, x_rows, nw_ptr, inv, kk, row_mask, K, PRO_NORM: tl.constexpr, INTERP: tl.constexpr,
                    ACT_FP8: tl.constexpr):  # fmt: skip
    """acc += the K step's product: _accumulate on decoded codes, or under ACT_FP8 the codes times
    the activation columns rounded through FP8, then the row's and the activation row's scales."""
    if ACT_FP8:
        xv = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
        xq, xs = act_fp8_block(xv)
        return acc + tl.dot(v, tl.trans(xq)) * s[:, None] * xs[None, :]
    else:
        return _accumulate(acc, v, s, x_rows, nw_ptr, inv, kk, row_mask, K, PRO_NORM, INTERP)


@triton.jit
def _accumulate3(acc3, v, s, x_row, nw_ptr, inv, cols, K, PRO_NORM: tl.constexpr):
    """acc3 [BLOCK_N, NBK, SUB_K] += codes * their block scales * the activation columns ``cols`` [NBK, SUB_K]."""
    xv = tl.load(x_row + cols, mask=cols < K, other=0.0)
    if PRO_NORM:
        nw = tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * inv * nw).to(xv.dtype)  # rounded as the bf16 norm is
    return acc3 + (v * s[:, :, None]) * xv.to(tl.float32)[None, :, :]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    w2_ptr,
    s2_ptr,
    nw_ptr,
    out_ptr,
    B,
    N,
    N_A,
    K,
    stride_xb,
    stride_wn,
    stride_sn,
    stride_w2n,
    stride_s2n,
    stride_ob,
    stride_os,
    group_rows,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    NBK: tl.constexpr,
    SUB_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    EVEN_W: tl.constexpr,
    GROUPED: tl.constexpr,
    TWO_W: tl.constexpr,
    PRO_NORM: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    USE_DOT: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    part_ptr=None,
    cnt_ptr=None,
    part_plane=0,
    REDUCE: tl.constexpr = 0,
    x2_ptr=None,
    stride_x2b=0,
    x2_div=1,
    CAT_K: tl.constexpr = False,
    ALIGNED_W: tl.constexpr = False,
    ACT_FP8: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)  # BLOCK_B = 1 without dot
    row_mask = rows < B

    if TWO_W:
        if n0 >= N_A:
            local = offs_n - N_A
            w_base = w2_ptr + local.to(tl.int64) * stride_w2n
            s_rows = s2_ptr + (local // 128) * stride_s2n
        else:
            w_base = w_ptr + offs_n.to(tl.int64) * stride_wn
            s_rows = s_ptr + (offs_n // 128) * stride_sn
    else:
        w_base = w_ptr + offs_n.to(tl.int64) * stride_wn
        s_rows = s_ptr + (offs_n // 128) * stride_sn
    x_col0 = 0
    if GROUPED:
        x_col0 = (n0 // group_rows) * K
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xb + x_col0
    x_row = x_ptr + pid_b.to(tl.int64) * stride_xb + x_col0  # the FMA variant's one row
    k_begin = pid_k * K_PER_SPLIT
    if CAT_K:
        if k_begin >= K:  # a part of W2's K: its own scale grid and activation rows ("two Ks")
            k_begin -= K
            w_base = w2_ptr + offs_n.to(tl.int64) * stride_w2n
            s_rows = s2_ptr + (offs_n // 128) * stride_s2n
            x_rows = x2_ptr + (rows // x2_div).to(tl.int64)[:, None] * stride_x2b
            x_row = x2_ptr + (pid_b // x2_div).to(tl.int64) * stride_x2b

    if USE_DOT:
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_base[:, None]
        # The first weight tile before pdl_wait, as in gemv: weights are constant during a step.
        v_first, s_first = _dot_tile(w_rows, s_rows, k_begin + offs_k, k_begin, n_mask, K, EVEN_W, NATIVE, ALIGNED_W,
                                     ACT_FP8)  # fmt: skip
        pdl_wait(PDL)
        if PRO_NORM:
            ss = tl.zeros([BLOCK_B], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                xv = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
                xv = xv.to(tl.float32)
                ss += tl.sum(xv * xv, 1)
            inv = 1.0 / tl.sqrt(ss / K + eps)
        else:
            inv = tl.zeros([BLOCK_B], dtype=tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        acc = _dot_accumulate(acc, v_first, s_first, x_rows, nw_ptr, inv, k_begin + offs_k, row_mask, K, PRO_NORM,
                              INTERP, ACT_FP8)  # fmt: skip
        for k0 in range(k_begin + BLOCK_K, k_begin + K_PER_SPLIT, BLOCK_K):
            kk = k0 + offs_k
            v, s = _dot_tile(w_rows, s_rows, kk, k0, n_mask, K, EVEN_W, NATIVE, ALIGNED_W, ACT_FP8)
            acc = _dot_accumulate(acc, v, s, x_rows, nw_ptr, inv, kk, row_mask, K, PRO_NORM, INTERP, ACT_FP8)
        total = acc
    else:
        # Batch 1, wide tiles [BLOCK_N, NBK, SUB_K] (see "wide tiles"): one activation row.
        cols = tl.arange(0, NBK)[:, None] * SUB_K + tl.arange(0, SUB_K)[None, :]
        v_first, s_first = fp8_tile3(w_base, s_rows, k_begin, n_mask, K, NBK, SUB_K, EVEN_W, NATIVE, ALIGNED_W)
        pdl_wait(PDL)
        inv = 0.0
        if PRO_NORM:
            ss = tl.zeros([NBK, SUB_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xv = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                ss += xv * xv
            inv = 1.0 / tl.sqrt(tl.sum(tl.sum(ss, 1), 0) / K + eps)
        acc3 = _accumulate3(tl.zeros([BLOCK_N, NBK, SUB_K], dtype=tl.float32), v_first, s_first, x_row, nw_ptr, inv,
                            k_begin + cols, K, PRO_NORM)  # fmt: skip
        for k0 in range(k_begin + BLOCK_K, k_begin + K_PER_SPLIT, BLOCK_K):
            v, s = fp8_tile3(w_base, s_rows, k0, n_mask, K, NBK, SUB_K, EVEN_W, NATIVE, ALIGNED_W)
            acc3 = _accumulate3(acc3, v, s, x_row, nw_ptr, inv, k0 + cols, K, PRO_NORM)
        total = tl.sum(tl.sum(acc3, 2), 1)[:, None]

    mask = n_mask[:, None] & row_mask[None, :]
    if REDUCE > 1:
        # "split K, reduced": this part's partials, then the sum by the tile's last part to finish.
        at = rows.to(tl.int64)[None, :] * N + offs_n[:, None]
        plane = part_plane  # B * N from the host: at B == 1 the compiler holds B as a constant int
        tl.store(part_ptr + pid_k * plane + at, total, mask=mask)
        if last_to_arrive(cnt_ptr + pid_n * tl.num_programs(1) + pid_b, REDUCE):
            total = tl.zeros_like(total)
            for j in tl.static_range(REDUCE):  # in part order: the same sums whichever part came last
                total += tl.load(part_ptr + j * plane + at, mask=mask, other=0.0, volatile=True)
            ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_ob + offs_n[:, None]
            if ACCUMULATE:
                total += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs = out_ptr + pid_k * stride_os + rows.to(tl.int64)[None, :] * stride_ob + offs_n[:, None]
        if ACCUMULATE:
            total += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


# ---- host side ------------------------------------------------------------------------------


def native_fp8_supported(device: torch.device) -> bool:
    """Whether e4m3 codes can be loaded as fp8 and converted by the hardware (compiled, sm89+)."""
    if device.type != "cuda" or interpreting() or not hasattr(tl, "float8e4nv"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _weight_bytes(w: torch.Tensor, name: str) -> torch.Tensor:
    if w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise InputError(describe(f"fp8_gemv {name} dtype", "float8_e4m3fn or its uint8 bytes", w.dtype))
    if w.dim() != 2 or w.stride(1) != 1:
        raise InputError(
            describe(
                f"fp8_gemv {name}",
                "a 2-D [N, K] weight with unit last stride",
                f"shape {list(w.shape)} strides {list(w.stride())}",
            )
        )
    return w


def _scale_bytes(s: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
    expected = fp8_scale_shape(w.shape)
    if tuple(s.shape) != expected or s.dtype not in (torch.float8_e8m0fnu, torch.uint8) or s.stride(1) != 1:
        raise InputError(
            describe(
                f"fp8_gemv {name}",
                f"float8_e8m0fnu / uint8 {list(expected)}, unit last stride",
                f"{s.dtype} {list(s.shape)}",
                "one UE8M0 byte per 128 x 128 tile",
            )
        )
    return s.view(torch.uint8)


def _geometry(b: int, n: int, n_a: int, k: int, config: GemvConfig, two_w: bool, group_rows: int, split_k: int):
    """(config, block_n, block_k, block_b) of one launch: the config's tile fitted to the shapes."""
    cfg = config
    if not cfg.use_dot and b != 1:
        cfg = DEFAULT  # the FMA variant holds one activation row
    block_n = min(cfg.block_n, max(16 if cfg.use_dot else 1, next_pow2(n)))
    if cfg.block_k & (cfg.block_k - 1) or cfg.block_k < 16:
        raise InputError(describe("fp8_gemv config block_k", "a power of two >= 16", cfg.block_k))
    # A dot tile lies in one scale block; an FMA tile may span several (see "wide tiles").
    block_k = min(cfg.block_k, max(16, next_pow2(k)))
    while block_n > 1 and ((two_w and n_a % block_n) or (group_rows and group_rows % block_n)):
        block_n //= 2  # a row block must not straddle the two matrices or two groups
    if cfg.use_dot and block_n < 16:
        if b != 1:
            raise InputError(
                describe("fp8_gemv row blocks", f"16 rows tiling {n_a} rows / groups of {group_rows}", f"batch {b}")
            )
        cfg = GemvConfig(block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, use_dot=False)
    if cfg.use_dot:
        block_k = min(block_k, FP8_BLOCK)
    while split_k > 1 and block_k > 16 and k % (split_k * block_k):
        block_k //= 2  # each part of K a whole number of tiles
    return cfg, block_n, block_k, batch_block(b) if cfg.use_dot else 1


def split_tiles(b: int, n: int, n_a: int, k: int, config: GemvConfig, two_w: bool = False, group_rows: int = 0,
                split_k: int = 2) -> int:  # fmt: skip
    """Output tiles of a launch at these shapes: the arrival counts a reduced split K needs."""
    _, block_n, _, block_b = _geometry(b, n, n_a, k, config, two_w, group_rows, split_k)
    return triton.cdiv(n, block_n) * triton.cdiv(b, block_b)


def _check_split_reduce(split_reduce, split_k: int, b: int, n: int, tiles: int) -> None:
    partials, arrivals = split_reduce
    if partials.dtype != torch.float32 or partials.numel() < split_k * b * n or not partials.is_contiguous():
        raise InputError(describe("fp8_gemv split_reduce partials", f"contiguous fp32, {split_k * b * n} elements",
                                  f"{partials.dtype} {list(partials.shape)}",
                                  "split_k x B x N fp32 partials, carved from the op's scratch"))  # fmt: skip
    if arrivals.dtype != torch.int32 or arrivals.numel() < tiles:
        raise InputError(describe("fp8_gemv split_reduce arrivals", f"int32, {tiles} counts (zeroed)",
                                  f"{arrivals.dtype} {list(arrivals.shape)}",
                                  "one count a tile: fp8_linear.split_tiles gives how many"))  # fmt: skip


def _check_two_ks(x, x2, div, w, w2, split_k, split_reduce, group_rows, norm_w) -> None:
    """The "two Ks" form's own rules (fp8_gemv's x2)."""
    b = x.shape[0]
    shapes = w2 is not None and tuple(w2.shape) == tuple(w.shape) and int(div) >= 1
    rows = x2.dim() == 2 and x2.dtype == x.dtype and x2.stride(1) == 1 and x2.shape[1] == w.shape[1]
    rows = rows and x2.shape[0] * int(div) >= b
    split = split_k >= 2 and split_k % 2 == 0 and split_reduce is not None
    if not (shapes and rows and split and not group_rows and norm_w is None):
        raise InputError(
            describe(
                "fp8_gemv x2 (two Ks)",
                "W2 of W's shape, x2 [ceil(B / x2_row_div), K] of x's dtype with unit last stride, an even "
                "split_k with split_reduce, no group_rows or norm_w",
                f"w2 {None if w2 is None else list(w2.shape)}, x2 {x2.dtype} {list(x2.shape)}, x2_row_div {div}, "
                f"split_k {split_k}, split_reduce {split_reduce is not None}",
            )
        )


def act_fp8_fits(cfg: GemvConfig, block_k: int, even_w: bool, native: bool, norm_w) -> bool:
    """Whether a launch can multiply on the FP8 tensor cores (note "W8A8 on the tensor cores"):
    the dot tiles on whole 128-column scale blocks of fp8 loads, no prologue norm, compiled."""
    return cfg.use_dot and block_k == FP8_BLOCK and even_w and native and norm_w is None and not interpreting()


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    w2: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
    group_rows: int = 0,
    split_k: int = 1,
    accumulate: bool = False,
    config: GemvConfig = DEFAULT,
    native_fp8: bool | None = None,
    split_reduce: tuple[torch.Tensor, torch.Tensor] | None = None,
    x2: torch.Tensor | None = None,
    x2_row_div: int = 1,
    act_fp8: bool = False,
) -> None:
    """out[B, N] (+)= x[B, K] @ dequant([W; W2])^T, W FP8 e4m3 with 128 x 128 UE8M0 block scales.

    Mirrors ``gemv.gemv`` (same options, same strided ``x`` / ``out`` with unit last stride);
    the weights come with their scales. ``accumulate`` adds into ``out`` (fp32 add, one
    rounding). With ``split_k`` > 1, out is [split_k, B, N] fp32 partials, unless
    ``split_reduce`` = (partials, arrivals) is given: then each part writes its fp32 partials to
    ``partials`` ([split_k * B * N] at least) and the last part of each tile to finish sums them
    into ``out`` (note "split K, reduced"); ``arrivals`` (int32, one per tile: :func:`split_tiles`)
    must be zero at the launch and is zero again after it. ``native_fp8``: None picks the hardware
    conversion where it exists (:func:`native_fp8_supported`).

    With ``x2`` (note "two Ks"), W2 [N, K] is a second matrix along K, not more rows:
    out[r] = x[r] @ W^T + x2[r // x2_row_div] @ W2^T, each half of the split's parts on one of
    them (``split_k`` even, ``split_reduce`` given).

    ``act_fp8`` (W8A8): x (and x2) rounded through FP8 per 1 x 128 run first, as
    ``runtime.model.quant.fp8_round_activations`` rounds them; on the FP8 tensor cores where the
    launch allows it (:func:`act_fp8_fits`, note "W8A8 on the tensor cores"), else rounded first
    (the same values, by ``fp8_round.fp8_round_rows``: one launch) and multiplied as bf16.

    Example
    -------
    >>> q, s = quantize_fp8(torch.randn(4096, 4096, device="cuda") / 64)  # runtime.model.quant
    >>> x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    >>> out = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    >>> fp8_gemv(x, q, s, out)
    """
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2 or x.stride(1) != 1:
        raise InputError(
            describe(
                "fp8_gemv x",
                "bf16 / fp16 [B, K] with unit last stride",
                f"{x.dtype} {list(x.shape)}",
                "the dot path multiplies in x's dtype",
            )
        )
    _weight_bytes(w, "w")
    s = _scale_bytes(w_scale, w, "w_scale")
    if (w2 is None) != (w2_scale is None):
        raise InputError(describe("fp8_gemv w2 / w2_scale", "both or neither", (w2 is None, w2_scale is None)))
    b, k = x.shape[0], w.shape[1]
    n_a = w.shape[0]
    if w2 is not None:
        _weight_bytes(w2, "w2")
        s2 = _scale_bytes(w2_scale, w2, "w2_scale")
        if w2.shape[1] != k:
            raise InputError(describe("fp8_gemv w2 columns", k, w2.shape[1]))
    cat_k = x2 is not None
    n = n_a + (w2.shape[0] if w2 is not None and not cat_k else 0)
    if cat_k:
        _check_two_ks(x, x2, x2_row_div, w, w2, split_k, split_reduce, group_rows, norm_w)
    if act_fp8 and norm_w is not None:  # W8A8 rounds the normed input; the prologue norms after any rounding
        raise InputError(describe("fp8_gemv act_fp8 with norm_w", "one of them", "both",
                                  "norm x first (W8A8 rounds the norm's output), then call with act_fp8 alone"))
    native = native_fp8_supported(x.device) if native_fp8 is None else bool(native_fp8)
    native = native and w.dtype == torch.float8_e4m3fn and (w2 is None or w2.dtype == torch.float8_e4m3fn)
    k_all = 2 * k if cat_k else k  # "two Ks": the parts run over W's K, then W2's
    cfg, block_n, block_k, block_b = _geometry(b, n, n_a, k_all, config, w2 is not None and not cat_k, group_rows,
                                               split_k)  # fmt: skip
    sub_k = min(block_k, FP8_BLOCK)
    reduced = split_k > 1 and split_reduce is not None
    if split_k > 1 and k_all % (split_k * block_k):
        raise InputError(describe("fp8_gemv split_k", f"K {k_all} in {split_k} parts of {block_k}-column tiles",
                                  k_all, "a split_k dividing K / 16"))  # fmt: skip
    if reduced:
        tiles = triton.cdiv(n, block_n) * triton.cdiv(b, block_b)
        _check_split_reduce(split_reduce, split_k, b, n, tiles)
    elif split_k > 1 and (accumulate or out.dtype != torch.float32):
        raise InputError(
            describe(
                "fp8_gemv split_k",
                "fp32 partials and no accumulate (or split_reduce)",
                f"out {out.dtype}, accumulate={accumulate}",
            )
        )
    even_w = (n % block_n == 0) and (k % block_k == 0)
    on_cores = act_fp8 and act_fp8_fits(cfg, block_k, even_w, native, norm_w)
    if act_fp8 and not on_cores:  # the same rounding, then the bf16 path
        # grouped: each group's K columns are runs of their own, as the reference rounds o per group
        x = fp8_round_rows(x.reshape(b, -1, k)).reshape(b, -1) if group_rows else fp8_round_rows(x)
        x2 = None if x2 is None else fp8_round_rows(x2)
    k_per = k_all // split_k if split_k > 1 else triton.cdiv(k, block_k) * block_k
    grid = (triton.cdiv(n, block_n), triton.cdiv(b, block_b), split_k)
    wk = w if native else w.view(torch.uint8)
    w2k = (w2 if native else w2.view(torch.uint8)) if w2 is not None else wk
    s2k = s2 if w2 is not None else s
    nw = norm_w if norm_w is not None else x
    stride_os = out.stride(0) if split_k > 1 and not reduced else 0
    out2 = out[0] if split_k > 1 and not reduced else out
    extra = dict(part_ptr=split_reduce[0], cnt_ptr=split_reduce[1], part_plane=b * n, REDUCE=split_k) if reduced else {}
    if cat_k:
        extra.update(x2_ptr=x2, stride_x2b=x2.stride(0), x2_div=int(x2_row_div), CAT_K=True)
    _fp8_gemv_kernel[grid](
        x, wk, s, w2k, s2k, nw, out2,
        b, n, n_a, k,
        x.stride(0), wk.stride(0), s.stride(0), w2k.stride(0), s2k.stride(0), out2.stride(0), stride_os,
        max(group_rows, 1), float(eps),
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_B=block_b, NBK=block_k // sub_k, SUB_K=sub_k, K_PER_SPLIT=k_per,
        EVEN_W=even_w, ACT_FP8=on_cores,
        GROUPED=bool(group_rows), TWO_W=w2 is not None and not cat_k, PRO_NORM=norm_w is not None,
        ACCUMULATE=accumulate,
        USE_DOT=cfg.use_dot, NATIVE=native, INTERP=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ALIGNED_W=k % 16 == 0 and rows_aligned(wk, w2k),
        **extra, **pdl_args(x.device),
    )  # fmt: skip


def project(
    x: torch.Tensor,
    w: torch.Tensor | QuantWeight,
    out: torch.Tensor,
    *,
    config: GemvConfig,
    w2: torch.Tensor | QuantWeight | None = None,
    norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
    group_rows: int = 0,
    accumulate: bool = False,
    split_k: int = 1,
    split_reduce: tuple[torch.Tensor, torch.Tensor] | None = None,
    act_fp8: bool = False,
    fp8_config: GemvConfig | None = None,
) -> None:
    """out (+)= x @ [W; W2]^T with W a bf16 tensor (``gemv.gemv``) or an FP8 QuantWeight (:func:`fp8_gemv`).

    The fused ops' one GEMV call on either kind of weight: ``config`` is the bf16 GEMV's; the
    FP8 one passes its ``data`` and ``scale`` with this module's configs (:func:`config_for`).
    ``w2`` must be of ``w``'s kind; ``accumulate`` needs FP8 (the bf16 GEMV overwrites). With
    ``split_k`` > 1, out is [split_k, B, N] fp32 partials (both GEMVs), or with ``split_reduce``
    (FP8 only) the summed output (:func:`fp8_gemv`, note "split K, reduced"). FP8 only:
    ``act_fp8`` (W8A8, :func:`fp8_gemv`'s) and ``fp8_config`` (the tiles, in place of :func:`config_for`'s).
    """
    if not isinstance(w, QuantWeight):
        fp8_only = accumulate or split_reduce is not None or act_fp8 or fp8_config is not None
        if isinstance(w2, QuantWeight) or fp8_only:
            raise InputError(
                describe(
                    "project on a bf16 weight",
                    "a bf16 w2, no accumulate, no split_reduce, no act_fp8, no fp8_config",
                    f"w2 {type(w2).__name__}, accumulate={accumulate}, split_reduce={split_reduce is not None}, "
                    f"act_fp8={act_fp8}, fp8_config={fp8_config}",
                )
            )
        gemv(x, w, out, w2=w2, norm_w=norm_w, eps=eps, group_rows=group_rows, split_k=split_k, config=config)
        return
    for m in (w, w2):
        if m is not None and (not isinstance(m, QuantWeight) or m.fmt != "fp8"):
            raise InputError(
                describe(
                    "project weights", "FP8 QuantWeights (no MXFP4 GEMV here)", getattr(m, "fmt", type(m).__name__)
                )
            )
    fp8_gemv(
        x,
        w.data,
        w.scale,
        out,
        w2=None if w2 is None else w2.data,
        w2_scale=None if w2 is None else w2.scale,
        norm_w=norm_w,
        eps=eps,
        group_rows=group_rows,
        accumulate=accumulate,
        split_k=split_k,
        config=fp8_config or config_for(x.shape[0], w.data.shape[0] + (0 if w2 is None else w2.data.shape[0]),
                                        split_k),
        split_reduce=split_reduce,
        act_fp8=act_fp8,
    )


def fp8_gemv_bytes(n: int, k: int, batch: int = 1, x_itemsize: int = 2, out_itemsize: int = 2) -> int:
    """The bytes one call must move: the FP8 weight, its scale grid, x once, out once."""
    grid_r, grid_c = fp8_scale_shape((n, k))
    return n * k + grid_r * grid_c + batch * (k * x_itemsize + n * out_itemsize)
