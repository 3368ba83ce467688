"""The MoE experts with MXFP4 routed experts and an FP8 shared expert, read in place.

The routed experts stay as the checkpoint stores them, stacked by ``prepare_weights``:
w1 / w3 [E, I, D/2] and w2 [E, D, I/2] bytes (two e2m1 codes each, the even column in the
low nibble) with UE8M0 scales [E, I, D/32] / [E, D, I/32], one per 32 columns of a row
(``runtime/model/quant.py``). The shared expert is FP8 e4m3 with 128 x 128 block scales
(``fp8_linear``). Expert ids and routing weights come from the route kernel of ``moe.py``
(device tensors [B, K]: no host sync, capturable); the gate stays bf16 and is not here.

The kernels are ``moe.py``'s and ``moe_grouped.py``'s with the weight tiles decoded in
registers:
- slot-major (batch 1; ``grouped=False``): w13, grid (I blocks, B*K + 1 slots), writes
  act = w * silu(min(g, limit)) * clamp(u, -limit, limit) per slot (bf16, as the reference
  rounds it); the last slot is the shared expert, weight 1. w2, grid (D blocks): one flat
  (slot, k) loop over the routed slots, then the shared expert's K loop, fp32 accumulation,
  one store into ``out`` (or an add to it: ``accumulate``).
- expert-major (batch > 1; ``grouped=True``): w13 and w2 on the same grid, but only the
  owner slot of an expert (``moe_grouped._owned_rows``) streams it, once for all the rows
  that chose it; w2 writes fp32 partials per (row, k); a reduce sums each row's
  first-occurrence partials and the shared one in k order (deterministic, no atomics).

A negative expert id (``moe.NO_EXPERT``, written by the route for moe_shard's pairs of another
rank's experts) reads no expert bytes in either layout and adds nothing; ``shared=None`` leaves
the shared slot out (moe_shard on a rank without the shared expert).

Note "MXFP4 tile": a [BLOCK_N, BLOCK_K] tile of logical columns is BLOCK_K / 2 bytes a row.
Each byte gives two values (low nibble: even column). The dot path (``mxfp4_halves``, batch > 1)
never interleaves them back into column order (a join and reshape move the tile through shared
memory): it multiplies the even and odd halves, each times its 32-column scale, by the even and
odd activation columns in two dots; e2m1 times a power of two is exact in bf16. The FP8 shared
expert's tiles apply their row scale to the tile's partial product (``fp8_linear``).

Note "MXFP4 words" (batch 1, ``mxfp4_rows_dot``): the tile is read as int32 words of 8 codes,
[scale blocks, rows, 4 words], and each lane loads the activation's bf16 pairs and the scale of
its own words itself (inline ``ld.global.nc``): no layout conversion through shared memory, no
barrier in the loop (loaded as a [blocks, 4] tile, the activation cost two a tile). A word's 8
products are summed in fp32 and times the block's scale. w1 and w3 share one loop (twice the
bytes in flight a program). BLOCK_K may span many scale blocks (and FP8 ones, for the shared
expert: ``fp8_linear``'s "wide tiles"): at batch 1 the kernel is bound by the bytes in flight,
and one program's loads are one tile. At b93df2d the 16 x 64-byte tiles, decoded per element in
fp32 (about 17 SASS instructions a code), ran the batch-1 MoE at 10% of copy bandwidth on an H200.

Note "e2m1 by bits" (``E2M1_HALVES_PTX``; ``moe_mxfp4_mma``'s word decode): a code s e1 e0 m
placed as the bf16 bits s at 15, e1 e0 m at 8..6 is the value times 2^-126 (e = 0: a bf16
subnormal, exact), so one bf16x2 multiply by 2^126 gives two values exactly. Per pair of codes:
a byte permute (both nibbles of a byte into the two halves, the other bytes zero), an integer
multiply by 0x1040 (the nibble shifted by 6 and by 12 at once, no carries), a mask, the
multiply: about 2.4 instructions a code with the word's two nibble masks. The multiply is
written as fma.rn.bf16x2 with -0 added (exact, the product's sign kept): mul.bf16x2 needs sm_90,
the fma sm_80 (A100, and the sm_89 cards), and ptxas emits the same HFMA2 for both.
``tests/test_e2m1_ptx.py`` runs the PTX text on a model of its instructions for every byte; the
interpreter runs arithmetic twins with the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.triton._common import (
    batch_block,
    carve,
    clamped_swiglu,
    interpreting,
    mma,
    next_pow2,
    pdl_args,
    pdl_wait,
    scratch_bytes,
    splat,
)
from draftgraph.ops.triton.fp8_linear import fp8_tile, fp8_tile3, native_fp8_supported, ue8m0_to_f32
from draftgraph.ops.triton.gemv import GemvConfig
from draftgraph.ops.triton.lanes import bf16_hi, bf16_lo, ld_u8, ld_v4
from draftgraph.ops.triton.moe_grouped import _moe_reduce_kernel, _owned_rows
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.model.quant import FP8_BLOCK, MXFP4_BLOCK, fp8_scale_shape

MAX_BATCH = 64  # the shared slot covers all rows in one activation tile
GROUPED_MIN_BATCH = 2  # as moe.py: expert-major from this batch on
# Batch 1: FMA word tiles (see "MXFP4 words", "e2m1 as fp16"). Tuned on one H100 at V4-Flash shapes
# (`bench_kernels.py --weights native --tune --tune-jobs moe:1`, 84a9f63,
# benchmarks/h200/bench_kernels_native_tuned_84a9f63_h100.txt): the MoE 65.2 us (w13 39.2, w2 20.6)
# against a 31.8 us floor; 81.1 on the 4 x 1024 1-warp tile of the GEMV variants. On an H200 at
# bbbd33f the bf16x2 decode ran it in 80.6 us; the 128-column tiles with the per-element decode in
# 222.8 (b93df2d). Batch > 1 (dot, at most 128 columns: an FP8 tile in
# one scale block): tuned at batch 32 (random routing) at b93df2d and again at bbbd33f (the same
# 128 x 128 won: 2911 us with the PTX decode, 5365 before); expert-major at batch 1 is slower.
W13_CONFIG = GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3, use_dot=False)
W2_CONFIG = GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=3, use_dot=False)
# Expert-major up to MMA_MAX_BATCH rows (bf16 x; all of them: MAX_BATCH): the routed experts'
# decoded words multiplied by the rows that chose them, 8 at a time, on the tensor cores
# (moe_mxfp4_mma); 16 rows a warp. Tuned on one H100 (04300e5,
# benchmarks/h200/bench_kernels_native_tuned_04300e5_h100.txt): the MoE at B=4 (random routing,
# ~23 experts) 366.6 us on the FMA rows kernel of 45f7cd2 (since removed), 241.4 on these tiles;
# the chain at B=8 1.229 -> 0.822 ms, at B=32 (23 experts, ~8 rows each) 1.580 on the dot tiles
# below -> 1.101 (bench_draft_native_*_h100.txt of that session).
MMA_MAX_BATCH = 64
MMA_ROWS = 8  # a batch tile of those kernels (the mma's n)
# Past MMA_ROWS rows a batch, the expert-row table cuts an expert's rows into chunks of this many, and a
# pass runs the words it decodes on two batch tiles (moe_mxfp4_mma, note "chunks of 16"). The chain on an
# H100 against chunks of 8 (benchmarks/h200/moe_chunks16_d881156_h100_log.txt): B=32 -21 us, B=16 -5.
MMA_CHUNK_ROWS = 16
# The largest UE8M0 byte whose scale times 2^126 is a bf16 (2^(byte - 1) <= 2^127): the condition of
# the tensor-core kernels' one-multiply decode (moe_mxfp4_mma, note "rebiased scale").
REBIAS_MAX_SCALE_BYTE = 128
W13_CONFIG_MMA = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=1, use_dot=False)
W2_CONFIG_MMA = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=1, use_dot=False)
# w2's register cap on the tensor cores: ptxas gave it 106 a thread, four 4-warp blocks a SM (25%
# occupancy, ncu); 96 lets five in. On an H100 (benchmarks/h200/gemv_knobs_one_process_h100_log.txt):
# w2 alone at B=32 80.6 -> 73.3 us; the chain B=32 0.8805 -> 0.8753 and 0.8801 -> 0.8719 ms in two
# calls, B=8 the same within noise (0.6627 -> 0.6623, 0.6583 -> 0.6605). 80 and 64 spill: slower
# (benchmarks/h200/moe_tiles_regs_507f8a9_h100_log.txt), as was any cap on w13 (128 a thread).
W2_MMA_MAXNREG = 96
# w13's K cut into this many parts, each a program of its own (moe_mxfp4_mma, "split K"); 1: none.
# On an H100 (benchmarks/h200/moe_split_022df2c_h100_log.txt), the MoE alone, parts 1 / 4 / 8:
# B=8 302 / 283 / 289 us (random routing), 177 / 158 / 167 (23 experts); B=32 806 / 753 / 863,
# 275 / 267 / 325. Two parts gave about half of four's gain.
W13_SPLIT_MMA = 4
# Past W13_SPLIT_LARGE_BATCH rows, two parts: the routed chunks alone keep the GPU busy, and the
# parts' partials and their sum cost more than the parallelism gives. The chain on an H100
# (benchmarks/h200/gemv_tiles_split_f1de8aa_h100_log.txt), replay ms with 4 / 2 parts: B=8 0.675 /
# 0.687, B=16 0.773 / 0.776, B=32 0.914 / 0.920, B=64 1.416 / 1.370. With the chunks of 16 (fewer,
# longer programs) two parts paid at B=32 already, so past 16 rows now (17-31 not timed apart): on an
# H200 (moe_w13_split_knobs_e74c8d5_h200_log.txt) B=32 0.702 / 0.702 ms with two parts against 0.712 /
# 0.712 with four; B=16 runs the same code either way.
W13_SPLIT_MMA_LARGE = 2
W13_SPLIT_LARGE_BATCH = 16
# The dot tiles: fp16 x, slot-major B > 1 (grouped=False), or B > MMA_MAX_BATCH.
W13_CONFIG_BATCHED = GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3)
W2_CONFIG_BATCHED = GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3)
REDUCE_BLOCK_D = 1024
MXFP4_DTYPES = tuple(dt for dt in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if dt is not None)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


@triton.jit
def e2m1_to_f32(c):
    """e2m1 codes (int32 0..15, bit 3 the sign) -> fp32: 0 .5 1 1.5 2 3 4 6, exactly, from the bits."""
    mag = c & 7
    e = (mag >> 1).to(tl.uint32)
    m = (mag & 1).to(tl.uint32)
    # e > 0: 2^(e-1) * (1 + m/2), fp32 exponent field e + 126; e == 0: m * 0.5 (exponent field 126).
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    bits = bits | ((c & 8).to(tl.uint32) << 28)
    return bits.to(tl.float32, bitcast=True)


# Four bytes (pack=4) and their scales as bf16 (two registers) -> the even and the odd codes of
# the four bytes, times 2^126, times the scale: two bf16x2 registers each.
E2M1_HALVES_PTX = tl.constexpr("""
{
.reg .b32 lo, hi, t, c, z;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
and.b32 lo, $4, 0x0F0F0F0F;
shr.u32 hi, $4, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, 0, 0x8180;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, c, z;
fma.rn.bf16x2 $0, t, $5, z;
prmt.b32 t, lo, 0, 0x8382;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, c, z;
fma.rn.bf16x2 $1, t, $6, z;
prmt.b32 t, hi, 0, 0x8180;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, c, z;
fma.rn.bf16x2 $2, t, $5, z;
prmt.b32 t, hi, 0, 0x8382;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, c, z;
fma.rn.bf16x2 $3, t, $6, z;
}
""")


@triton.jit
def ue8m0_bf16_bits(s):
    """UE8M0 bytes -> the bits of 2^(byte - 127) as bf16 (int32), as ue8m0_to_f32 (0: 2^-127, a
    subnormal; 255: NaN)."""
    b = s.to(tl.int32)
    return tl.where(b == 0, 0x40, tl.where(b == 255, 0x7FC0, b << 7))


@triton.jit
def _scale_bf16(s):
    """UE8M0 bytes -> 2^(byte - 127) as bf16."""
    return ue8m0_bf16_bits(s).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def mxfp4_halves(w_rows, s_rows, k0, n_mask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """(even, odd): the dequantised tiles [BLOCK_N, BLOCK_K / 2] of logical columns k0 + 2j and
    k0 + 2j + 1 (see "MXFP4 tile"), bf16 on the GPU (exact), fp32 under the interpreter.
    w_rows / s_rows: [BLOCK_N, 1] pointers to the rows' first byte / scale."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns
    mask = n_mask[:, None] & (kb < K // 2)[None, :]
    q = tl.load(w_rows + kb[None, :], mask=mask, other=0)
    sb = tl.load(s_rows + (kb // 16)[None, :], mask=mask, other=127)
    if INTERP:
        s = ue8m0_to_f32(sb)
        qi = q.to(tl.int32)
        return e2m1_to_f32(qi & 15) * s, e2m1_to_f32((qi >> 4) & 15) * s
    else:
        return tl.inline_asm_elementwise(
            E2M1_HALVES_PTX, "=r,=r,=r,=r,r,r,r", [q.to(tl.uint8, bitcast=True), _scale_bf16(sb)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )  # fmt: skip


# Note "e2m1 as fp16" (batch 1, ``mxfp4_rows_dot``): a code s e1 e0 m placed as the fp16 bits s at
# 15, e1 e0 m at 11..9 is its value times 2^-14 (e = 0: an fp16 subnormal, exact), so the hardware's
# fp16 -> fp32 conversion decodes it with no rebias multiply; the 2^-14 is undone once per word's
# 8-product sum (a power of two: exact). Per word of 8 codes: the two nibble halves spread over
# the bytes with their signs (8 ops), a byte permute per pair of codes into fp16x2 (4), 8 cvt;
# about 4.1 instructions a code with the products, against ~6.3 for the bf16x2 words
# (moe_mxfp4_mma's word decode), whose pairs must be unpacked to fp32 one by one anyway.
# (benchmarks/bench_mxfp4_gemv.py at 67ca29e, since removed: the w13 of six experts on an H100, 25.4 us
# against 38.1; benchmarks/h200/bench_mxfp4_gemv_45f7cd2_h100.txt.)
# $8: the word; $0..$7: its columns 0..7 as fp32, each times 2^-14.
E2M1_F16_PTX = tl.constexpr("""
{
.reg .b32 a, b, m, t, q0, q1, q2, q3;
.reg .b16 h0, h1, h2, h3, h4, h5, h6, h7;
and.b32 m, $8, 0x07070707;
shl.b32 a, m, 1;
shl.b32 t, $8, 4;
and.b32 t, t, 0x80808080;
or.b32 a, a, t;
and.b32 m, $8, 0x70707070;
shr.u32 b, m, 3;
and.b32 t, $8, 0x80808080;
or.b32 b, b, t;
prmt.b32 q0, a, 0, 0x1404;
prmt.b32 q1, a, 0, 0x3424;
prmt.b32 q2, b, 0, 0x1404;
prmt.b32 q3, b, 0, 0x3424;
mov.b32 {h0, h2}, q0;
mov.b32 {h4, h6}, q1;
mov.b32 {h1, h3}, q2;
mov.b32 {h5, h7}, q3;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
cvt.f32.f16 $4, h4;
cvt.f32.f16 $5, h5;
cvt.f32.f16 $6, h6;
cvt.f32.f16 $7, h7;
}
""")
F16_REBIAS = tl.constexpr(16384.0)  # 2^14


@triton.jit
def _e2m1_times_2m14(c):
    """e2m1 codes (int32 0..15) -> their values times 2^-14, as E2M1_F16_PTX decodes them."""
    return e2m1_to_f32(c) * 0.00006103515625


@triton.jit
def e2m1_word_f16(w, INTERP: tl.constexpr):
    """int32 words of 8 e2m1 codes -> 8 fp32 tensors, columns 0..7, each value times 2^-14."""
    if INTERP:  # the interpreter runs no PTX: the same values by arithmetic
        return (_e2m1_times_2m14(w & 15), _e2m1_times_2m14(w >> 4 & 15), _e2m1_times_2m14(w >> 8 & 15),
                _e2m1_times_2m14(w >> 12 & 15), _e2m1_times_2m14(w >> 16 & 15), _e2m1_times_2m14(w >> 20 & 15),
                _e2m1_times_2m14(w >> 24 & 15), _e2m1_times_2m14(w >> 28 & 15))  # fmt: skip
    else:
        return tl.inline_asm_elementwise(E2M1_F16_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _words_f16_dot(acc, w, s, a0, a1, a2, a3, INTERP: tl.constexpr):
    """acc += each word's 8 codes times its activation columns (a0..a3: bf16 pairs), times the block scale."""
    c0, c1, c2, c3, c4, c5, c6, c7 = e2m1_word_f16(w, INTERP)
    part = c0 * bf16_lo(a0)
    part += c1 * bf16_hi(a0)
    part += c2 * bf16_lo(a1)
    part += c3 * bf16_hi(a1)
    part += c4 * bf16_lo(a2)
    part += c5 * bf16_hi(a2)
    part += c6 * bf16_lo(a3)
    part += c7 * bf16_hi(a3)
    return acc + (part * F16_REBIAS) * ue8m0_to_f32(s)


@triton.jit
def _word_block(k0, blocks, words, K, EVEN: tl.constexpr):
    """(word columns [NB, 1, 4], scale columns [NB, 1, 1], live [NB, 1, 1]) of the tile's scale blocks
    from k0 on; a block past K (none: EVEN) reads its row's last block (a real address), masked."""
    b = k0 // 32 + blocks
    if EVEN:
        return b * 4 + words, b, b >= 0
    live = b < K // 32
    b = tl.minimum(b, K // 32 - 1)
    return b * 4 + words, b, live


@triton.jit
def _tile_dot(acc, w_rows, s_rows, kw, kb, live, a0, a1, a2, a3, EVEN: tl.constexpr, INTERP: tl.constexpr):
    """acc += one tile of a matrix (rows' first word / scale pointers [1, BLOCK_N, 1], the tile's
    word / scale columns from ``_word_block``) times the activation pairs a0..a3; its words masked
    by ``live`` (0: no product) unless EVEN (every row and block real)."""
    w = tl.load(w_rows + kw) if EVEN else tl.load(w_rows + kw, mask=live, other=0)
    return _words_f16_dot(acc, w, ld_u8(s_rows + kb, INTERP), a0, a1, a2, a3, INTERP)


@triton.jit
def mxfp4_rows_dot(
    x_ptr, wa_ptr, sa_ptr, wb_ptr, sb_ptr, w_off, s_off, n_live, K, k_end,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """(W_a[rows] @ x, W_b[rows] @ x) over K (up to k_end: 0 reads nothing) -> fp32 [BLOCK_N] each.

    Batch 1, MXFP4 (see "e2m1 as fp16"): wa_ptr / wb_ptr the matrices' bytes, sa_ptr / sb_ptr
    their scales; w_off / s_off [BLOCK_N] int64: each row's first word / scale (rows past the end
    given as a real row: n_live masks them); x bf16, 16-byte aligned, K % 32 == 0. The tile is
    [scale blocks, rows, 4 words] (see "MXFP4 words"); each lane loads the activation pairs and
    the scale of its own words (``ld_v4``, ``ld_u8``). Both matrices in one loop: twice the
    bytes in flight a program. EVEN: BLOCK_N and BLOCK_K divide the matrix (no masks).
    """
    NB: tl.constexpr = BLOCK_K // 32
    blocks = tl.arange(0, NB)[:, None, None]
    words = tl.arange(0, 4)[None, None, :]
    live_rows = n_live[None, :, None]
    w_rows = tl.multiple_of(w_off, 4)[None, :, None]  # K % 32 == 0: every row starts on 16 bytes
    s_rows = s_off[None, :, None]
    wa = wa_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_rows
    wb = wb_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_rows
    a_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    acc_a = tl.zeros([NB, BLOCK_N, 4], dtype=tl.float32)
    acc_b = tl.zeros([NB, BLOCK_N, 4], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kw, kb, live = _word_block(k0, blocks, words, K, EVEN)
        a0, a1, a2, a3 = ld_v4(a_words + kw * 4, INTERP)
        acc_a = _tile_dot(acc_a, wa, sa_ptr + s_rows, kw, kb, live & live_rows, a0, a1, a2, a3, EVEN, INTERP)
        acc_b = _tile_dot(acc_b, wb, sb_ptr + s_rows, kw, kb, live & live_rows, a0, a1, a2, a3, EVEN, INTERP)
    return tl.sum(tl.sum(acc_a, 2), 0), tl.sum(tl.sum(acc_b, 2), 0)


@triton.jit
def _expert_tiles(
    a_rows,
    a_mask,
    w_rows,
    s_rows,
    n_mask,
    K,
    k_end,
    IS_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """W[rows] @ a^T over K (up to k_end: 0 reads nothing) -> fp32 [BLOCK_N, BLOCK_B], by dot.

    a_rows: [BLOCK_B, 1] activation row pointers (a_mask: the rows read); W FP8 (w_rows
    [BLOCK_N] pointers to its rows, s_rows [BLOCK_N] to its scale-grid rows) or MXFP4 (w_rows /
    s_rows [BLOCK_N] pointers to the rows' first byte / scale). BLOCK_K at most 128.
    """
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        if IS_FP8:
            kk = k0 + offs_k
            av = tl.load(a_rows + kk[None, :], mask=a_mask[:, None] & (kk < K)[None, :], other=0.0)
            v, s = fp8_tile(w_rows[:, None], s_rows, kk, k0, n_mask, K, False, NATIVE)
            at = tl.trans(av)
            acc += mma(v.to(at.dtype), at, INTERP) * s[:, None]
        else:
            even, odd = mxfp4_halves(w_rows[:, None], s_rows[:, None], k0, n_mask, K, BLOCK_N, BLOCK_K, INTERP)
            kk = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            m = a_mask[:, None] & (kk < K)[None, :]
            a_even = tl.trans(tl.load(a_rows + kk[None, :], mask=m, other=0.0))
            a_odd = tl.trans(tl.load(a_rows + kk[None, :] + 1, mask=m, other=0.0))
            acc += mma(even.to(a_even.dtype), a_even, INTERP) + mma(odd.to(a_odd.dtype), a_odd, INTERP)
    return acc


@triton.jit
def _fp8_rows_fma(
    a_row,
    w_rows,
    s_rows,
    n_mask,
    K,
    k_end,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    EVEN: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """W[rows] @ a over K (up to k_end: 0 reads nothing) -> fp32 [BLOCK_N, 1], one activation row, W FP8
    (the shared expert; fp8_linear's wide tiles: w_rows [BLOCK_N] row pointers, s_rows [BLOCK_N]
    scale-grid rows). a_row: the row's pointer (bf16). EVEN: no masks (BLOCK_N and BLOCK_K divide W).
    """
    NBK: tl.constexpr = BLOCK_K // SUB_K
    cols = tl.arange(0, NBK)[:, None] * SUB_K + tl.arange(0, SUB_K)[None, :]
    acc3 = tl.zeros([BLOCK_N, NBK, SUB_K], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        v, s = fp8_tile3(w_rows, s_rows, k0, n_mask, K, NBK, SUB_K, EVEN, NATIVE)
        av = tl.load(a_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        acc3 += (v * s[:, :, None]) * av[None, :, :]
    return tl.sum(tl.sum(acc3, 2), 1)[:, None]


@triton.jit
def _w13_kernel(
    x_ptr,
    idx_ptr,
    wts_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    sw1_ptr,
    ss1_ptr,
    sw3_ptr,
    ss3_ptr,
    act_ptr,
    B,
    D,
    INTER,
    stride_xb,
    stride_ssn,
    limit,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SUB_K: tl.constexpr,
    EVEN: tl.constexpr,
    GROUPED: tl.constexpr,
    USE_DOT: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    # The slots in reverse: the shared expert's programs (the last slot; twice a routed program's
    # bytes at batch 1, FP8) are dispatched first, not left to run alone at the end of the launch.
    slot = tl.num_programs(1) - 1 - tl.program_id(1)
    routed = B * TOPK
    rows = tl.arange(0, BLOCK_B)  # BLOCK_B = 1 without dot (batch 1: row 0 for every slot)
    if GROUPED:
        e, shared, owner, serves, weight, dest = _owned_rows(idx_ptr, wts_ptr, slot, B, TOPK, TOPK_PAD, BLOCK_B)
        k_end = tl.where(owner, D, 0)  # a slot that does not own its expert reads nothing
    else:
        shared = slot >= routed  # only in the grid with a shared expert
        safe = tl.minimum(slot, routed - 1)
        e = tl.load(idx_ptr + safe).to(tl.int64)
        weight = rows * 0.0 + tl.where(shared, 1.0, tl.load(wts_ptr + safe))
        serves = tl.where(shared, rows < B, rows == tl.minimum(slot // TOPK, B - 1))
        dest = tl.where(shared, routed + rows, slot)
        k_end = tl.where(shared | (e >= 0), D, 0)  # a negative id (NO_EXPERT) reads nothing: act 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    n64 = offs_n.to(tl.int64)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xb
    if shared:
        sw1_rows = sw1_ptr + n64 * D
        sw3_rows = sw3_ptr + n64 * D
        s_rows = (offs_n // 128) * stride_ssn
        if USE_DOT:
            g = _expert_tiles(x_rows, serves, sw1_rows, ss1_ptr + s_rows, n_mask, D, k_end,
                              True, BLOCK_N, BLOCK_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
            u = _expert_tiles(x_rows, serves, sw3_rows, ss3_ptr + s_rows, n_mask, D, k_end,
                              True, BLOCK_N, BLOCK_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
        else:
            g = _fp8_rows_fma(x_ptr, sw1_rows, ss1_ptr + s_rows, n_mask, D, k_end,
                              BLOCK_N, BLOCK_K, SUB_K, EVEN, NATIVE)  # fmt: skip
            u = _fp8_rows_fma(x_ptr, sw3_rows, ss3_ptr + s_rows, n_mask, D, k_end,
                              BLOCK_N, BLOCK_K, SUB_K, EVEN, NATIVE)  # fmt: skip
    else:
        if USE_DOT:
            s_off = e * INTER * (D // 32) + n64 * (D // 32)
            w_off = e * INTER * (D // 2) + n64 * (D // 2)
            g = _expert_tiles(x_rows, serves, w1_ptr + w_off, s1_ptr + s_off, n_mask, D, k_end,
                              False, BLOCK_N, BLOCK_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
            u = _expert_tiles(x_rows, serves, w3_ptr + w_off, s3_ptr + s_off, n_mask, D, k_end,
                              False, BLOCK_N, BLOCK_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
        else:  # w1 and w3 in one loop (see "e2m1 as fp16"); rows past INTER read the last row, unstored
            n_c = tl.minimum(offs_n, INTER - 1).to(tl.int64)
            e_c = tl.maximum(e, 0)  # NO_EXPERT reads nothing (k_end 0): any real address
            g1, u1 = mxfp4_rows_dot(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, (e_c * INTER + n_c) * (D // 8),
                                    (e_c * INTER + n_c) * (D // 32), n_mask, D, k_end, BLOCK_N, BLOCK_K,
                                    EVEN, INTERP)  # fmt: skip
            g = g1[:, None]
            u = u1[:, None]
    act = clamped_swiglu(g, u, limit) * weight[None, :]
    ptrs = act_ptr + dest.to(tl.int64)[None, :] * INTER + offs_n[:, None]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=n_mask[:, None] & serves[None, :])


@triton.jit
def _w2_kernel(
    act_ptr,
    idx_ptr,
    w2_ptr,
    s2_ptr,
    sw2_ptr,
    ss2_ptr,
    out_ptr,
    B,
    D,
    INTER,
    stride_ob,
    stride_ssn,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SUB_K: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    USE_DOT: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Slot-major: one flat (slot, k) loop over the routed slots (INTER % BLOCK_K == 0), so the
    # pipeline never drains between experts; then the shared expert's FP8 loop.
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    n64 = offs_n.to(tl.int64)
    rows = tl.arange(0, BLOCK_B)
    routed = B * TOPK
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_K // 32, BLOCK_N, 4], dtype=tl.float32)  # the routed MXFP4 words
        n_c = tl.minimum(offs_n, D - 1).to(tl.int64)  # rows past D read the last row, unstored
        blocks = tl.arange(0, BLOCK_K // 32)[:, None, None]
        words = tl.arange(0, 4)[None, None, :]
        w2_words = w2_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        act_words = act_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    for t in range(0, routed * INTER, BLOCK_K):
        slot = t // INTER
        k0 = t - slot * INTER
        e = tl.load(idx_ptr + slot).to(tl.int64)
        if USE_DOT:
            s_rows = s2_ptr + e * D * (INTER // 32) + n64 * (INTER // 32)
            live = n_mask & splat(e >= 0, offs_n)  # a negative id (NO_EXPERT): nothing loaded, the tile is 0
            w_rows = w2_ptr + e * D * (INTER // 2) + n64 * (INTER // 2)
            even, odd = mxfp4_halves(w_rows[:, None], s_rows[:, None], k0, live, INTER, BLOCK_N, BLOCK_K, INTERP)
            src = tl.where(rows == slot // TOPK, slot, -1)
            cols = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            a_rows = act_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * INTER + cols[None, :]
            a_even = tl.trans(tl.load(a_rows, mask=(src >= 0)[:, None], other=0.0))
            a_odd = tl.trans(tl.load(a_rows + 1, mask=(src >= 0)[:, None], other=0.0))
            acc += mma(even.to(a_even.dtype), a_even, INTERP) + mma(odd.to(a_odd.dtype), a_odd, INTERP)
        elif e >= 0:  # mxfp4_rows_dot's tile, one matrix; NO_EXPERT adds nothing
            row = e * D + n_c
            kw, kb, _ = _word_block(k0, blocks, words, INTER, True)  # INTER % BLOCK_K == 0
            a0, a1, a2, a3 = ld_v4(act_words + slot.to(tl.int64) * (INTER // 2) + kw * 4, INTERP)  # row = slot
            acc = _tile_dot(acc, w2_words + tl.multiple_of(row * (INTER // 8), 4)[None, :, None],
                            s2_ptr + (row * (INTER // 32))[None, :, None], kw, kb, n_mask[None, :, None],
                            a0, a1, a2, a3, EVEN, INTERP)  # fmt: skip
    if USE_DOT:
        if HAS_SHARED:
            sw_rows = sw2_ptr + n64[:, None] * INTER
            ss_rows = ss2_ptr + (offs_n // 128) * stride_ssn
            for k0 in range(0, INTER, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                v, s = fp8_tile(sw_rows, ss_rows, kk, k0, n_mask, INTER, False, NATIVE)
                a = tl.load(act_ptr + (routed + rows).to(tl.int64)[:, None] * INTER + kk[None, :],
                            mask=(rows < B)[:, None], other=0.0)  # fmt: skip
                acc += mma(v.to(a.dtype), tl.trans(a), INTERP) * s[:, None]
        total = acc
    else:
        total = tl.sum(tl.sum(acc, 2), 0)[:, None]
        if HAS_SHARED:
            total += _fp8_rows_fma(act_ptr + routed * INTER, sw2_ptr + n64 * INTER,
                                   ss2_ptr + (offs_n // 128) * stride_ssn, n_mask, INTER, INTER,
                                   BLOCK_N, BLOCK_K, SUB_K, EVEN, NATIVE)  # fmt: skip
    ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_ob + offs_n[:, None]
    mask = n_mask[:, None] & (rows < B)[None, :]
    if ACCUMULATE:
        total += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w2_grouped_kernel(
    act_ptr,
    idx_ptr,
    wts_ptr,
    w2_ptr,
    s2_ptr,
    sw2_ptr,
    ss2_ptr,
    part_ptr,
    B,
    D,
    INTER,
    stride_ssn,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    e, shared, owner, serves, _, dest = _owned_rows(idx_ptr, wts_ptr, slot, B, TOPK, TOPK_PAD, BLOCK_B)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    n64 = offs_n.to(tl.int64)
    a_rows = act_ptr + dest.to(tl.int64)[:, None] * INTER
    k_end = tl.where(owner, INTER, 0)
    if shared:
        acc = _expert_tiles(a_rows, serves, sw2_ptr + n64 * INTER, ss2_ptr + (offs_n // 128) * stride_ssn,
                            n_mask, INTER, k_end, True, BLOCK_N, BLOCK_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
    else:
        w_rows = w2_ptr + e * D * (INTER // 2) + n64 * (INTER // 2)
        s_rows = s2_ptr + e * D * (INTER // 32) + n64 * (INTER // 32)
        acc = _expert_tiles(a_rows, serves, w_rows, s_rows, n_mask, INTER, k_end,
                            False, BLOCK_N, BLOCK_K, BLOCK_B, NATIVE, INTERP)  # fmt: skip
    ptrs = part_ptr + dest.to(tl.int64)[None, :] * D + offs_n[:, None]
    tl.store(ptrs, acc, mask=n_mask[:, None] & serves[None, :])


# ---- host side ------------------------------------------------------------------------------


def _fail(what: str, expected, got, hint: str | None = None):
    raise InputError(describe(f"moe_mxfp4 {what}", expected, got, hint))


def _bytes_of(t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple, what: str) -> torch.Tensor:
    """t checked (shape, dtype, contiguous) and viewed as uint8."""
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes or not t.is_contiguous():
        _fail(what, f"contiguous {list(shape)} of {' / '.join(str(d) for d in dtypes)}", f"{t.dtype} {list(t.shape)}")
    return t.view(torch.uint8)


def _check(x, idx, wts, w1, w1_scale, w2, w2_scale, w3, w3_scale, out, shared):
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1:
        _fail("x", "bf16 / fp16 [B, D] with unit last stride", f"{x.dtype} {list(x.shape)}")
    b, d = x.shape
    if not 1 <= b <= MAX_BATCH:
        _fail("batch", f"1..{MAX_BATCH}", b, "the shared slot covers all rows in one tile")
    if idx.dim() != 2 or idx.shape[0] != b or idx.dtype not in (torch.int32, torch.int64) or not idx.is_contiguous():
        _fail("idx", f"contiguous int32 [{b}, K]", f"{idx.dtype} {list(idx.shape)}")
    if tuple(wts.shape) != tuple(idx.shape) or wts.dtype != torch.float32 or not wts.is_contiguous():
        _fail("wts", f"contiguous float32 {list(idx.shape)}", f"{wts.dtype} {list(wts.shape)}")
    if w1.dim() != 3 or d % MXFP4_BLOCK:
        _fail("w1", f"[E, I, D/2] bytes, D a multiple of {MXFP4_BLOCK}", f"{list(w1.shape)}, D {d}")
    e, inter = w1.shape[0], w1.shape[1]
    if inter % MXFP4_BLOCK:
        _fail("intermediate size", f"a multiple of {MXFP4_BLOCK}", inter)
    if tuple(out.shape) != (b, d) or out.stride(1) != 1:
        _fail("out", f"[{b}, {d}] with unit last stride", f"{list(out.shape)} strides {list(out.stride())}")
    up = (e, inter, d // 2), (e, inter, d // MXFP4_BLOCK)
    down = (e, d, inter // 2), (e, d, inter // MXFP4_BLOCK)
    routed = [
        _bytes_of(w1, up[0], MXFP4_DTYPES, "w1"),
        _bytes_of(w1_scale, up[1], SCALE_DTYPES, "w1_scale"),
        _bytes_of(w3, up[0], MXFP4_DTYPES, "w3"),
        _bytes_of(w3_scale, up[1], SCALE_DTYPES, "w3_scale"),
        _bytes_of(w2, down[0], MXFP4_DTYPES, "w2"),
        _bytes_of(w2_scale, down[1], SCALE_DTYPES, "w2_scale"),
    ]
    for name, t in (("w1", routed[0]), ("w3", routed[2]), ("w2", routed[4])):
        if t.data_ptr() % 16:  # each row's words (D / 8 of them, D % 32 == 0) then start on 16 bytes too
            _fail(f"{name} start", "a 16-byte aligned address", f"{t.data_ptr()} (mod 16: {t.data_ptr() % 16})",
                  "the kernels read the codes as int32 words, 16 bytes at a time; pass a tensor of its own, "
                  "not an offset view")
    if shared is None:
        return routed, None
    sw1, sw1_scale, sw2, sw2_scale, sw3, sw3_scale = shared
    fp8 = (torch.float8_e4m3fn, torch.uint8)
    shared_checked = [
        _bytes_of(sw1, (inter, d), fp8, "sw1"),
        _bytes_of(sw1_scale, fp8_scale_shape((inter, d)), SCALE_DTYPES, "sw1_scale"),
        _bytes_of(sw3, (inter, d), fp8, "sw3"),
        _bytes_of(sw3_scale, fp8_scale_shape((inter, d)), SCALE_DTYPES, "sw3_scale"),
        _bytes_of(sw2, (d, inter), fp8, "sw2"),
        _bytes_of(sw2_scale, fp8_scale_shape((d, inter)), SCALE_DTYPES, "sw2_scale"),
    ]
    return routed, shared_checked


def _pow2_dividing(n: int, at_most: int) -> int:
    block = 1
    while block * 2 <= at_most and n % (block * 2) == 0:
        block *= 2
    return block


def moe_mxfp4_parts(batch: int, top_k: int, inter: int, d: int, dtype: torch.dtype, grouped: bool, shared: bool = True):
    """Scratch of one call, as :func:`_common.carve` parts: act rows (routed slots, then the
    shared expert per row, if any) and, expert-major, fp32 w2 partials per slot and the
    tensor-core kernels' expert-row table (moe_mxfp4_mma, "expert-row table": a count per routed
    slot, then its chunk's rows, act rows and weights, ``mma_chunk_rows`` a slot) and, with w13's K split
    (:func:`mma_split`), each part's fp32 partials and an arrival count per w13 tile."""
    slots = batch * top_k + (batch if shared else 0)
    routed = batch * top_k if grouped else 0
    table = (routed, mma_chunk_rows(batch))
    split, tiles = mma_split(batch, inter, d, dtype, grouped)
    return [((slots, inter), dtype), ((slots if grouped else 0, d), torch.float32), ((routed,), torch.int32),
            (table, torch.int32), (table, torch.int32), (table, torch.float32),
            ((split, 2, batch * top_k + batch, inter) if split > 1 else (0,), torch.float32),
            (((routed + 1) * tiles if split > 1 else 0,), torch.int32)]  # fmt: skip


def mma_chunk_rows(batch: int) -> int:
    """The expert-row table's chunk at ``batch`` rows (moe_mxfp4_mma, note "chunks of 16"): an expert has
    at most ``batch`` rows (a row picks it once), so up to MMA_ROWS no chunk is wider than one tile."""
    return MMA_CHUNK_ROWS if batch > MMA_ROWS else MMA_ROWS


def mma_split(batch: int, inter: int, d: int, dtype: torch.dtype, grouped: bool) -> tuple[int, int]:
    """(the parts w13's K is cut into, w13's row tiles a slot) on the tensor cores (moe_mxfp4_mma,
    "split K"): at most one part per 128 columns of D; (1, 0) where they do not run. The parts'
    scratch: their fp32 partials of every act row (w1 x, then w3 x) and an arrival count a tile."""
    parts = W13_SPLIT_MMA if batch <= W13_SPLIT_LARGE_BATCH else W13_SPLIT_MMA_LARGE
    split = min(parts, triton.cdiv(d, 128))
    if not (grouped and dtype == torch.bfloat16 and batch <= MMA_MAX_BATCH) or split <= 1:
        return 1, 0
    return split, triton.cdiv(inter, W13_CONFIG_MMA.block_n)


def rebias_fits(*scales) -> bool:
    """Whether every UE8M0 byte of ``scales`` is at most 128: the tensor-core kernels' one-multiply
    decode (moe_mxfp4_mma, note "rebiased scale"). A device read each; False, without reading, while
    the current stream captures a graph (the two-multiply decode is right for every scale)."""
    if any(s.is_cuda for s in scales) and torch.cuda.is_current_stream_capturing():
        return False
    return all(int(s.view(torch.uint8).max()) <= REBIAS_MAX_SCALE_BYTE for s in scales if s.numel())


def moe_mxfp4_workspace(
    batch: int, top_k: int, inter: int, d: int, dtype: torch.dtype, grouped: bool, shared: bool = True
) -> int:
    return scratch_bytes(moe_mxfp4_parts(batch, top_k, inter, d, dtype, grouped, shared))


def moe_mxfp4_launches(
    x: torch.Tensor,
    idx: torch.Tensor,
    wts: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu_limit: float,
    shared: tuple[torch.Tensor, ...] | None = None,
    accumulate: bool = False,
    workspace: torch.Tensor | None = None,
    grouped: bool | None = None,
    native_fp8: bool | None = None,
    rebias: tuple[bool, bool] | None = None,
) -> list[tuple[str, callable]]:
    """The launches of :func:`moe_mxfp4` as (name, thunk), for an op's ``plan`` (checks and scratch done here)."""
    (w1b, s1b, w3b, s3b, w2b, s2b), shared_b = _check(x, idx, wts, w1, w1_scale, w2, w2_scale, w3, w3_scale, out,
                                                      shared)  # fmt: skip
    if rebias is not None and not (type(rebias) is tuple and len(rebias) == 2 and all(type(r) is bool for r in rebias)):
        _fail("rebias", "None or (bool, bool): w1 and w3's scales, then w2's", repr(rebias),
              "rebias_fits(scale, ...) answers each; True is a promise that every byte is at most 128")
    b, d = x.shape
    top_k = idx.shape[1]
    inter = w1.shape[1]
    grouped = b >= GROUPED_MIN_BATCH if grouped is None else bool(grouped)
    # The word kernels read x as bf16 pairs (int32): fp16 x takes the dot tiles.
    bf16 = x.dtype == torch.bfloat16
    one_row = bf16 and b == 1 and not grouped and not W13_CONFIG.use_dot  # x 16 bytes at a time (mxfp4_rows_dot)
    use_mma = bf16 and grouped and b <= MMA_MAX_BATCH  # x 16 bytes at a time (moe_mxfp4_mma)
    if (one_row or use_mma) and (x.data_ptr() % 16 or (b > 1 and x.stride(0) % 8)):
        _fail("x layout", "a 16-byte aligned start and a row stride a multiple of 8",
              f"address mod 16 {x.data_ptr() % 16}, row stride {x.stride(0)}",
              "the batch-1 and mma kernels read x as bf16 pairs (int32), 16 bytes at a time; a contiguous copy "
              "of [B, D] has both")
    for name, c in (("W13_CONFIG_MMA", W13_CONFIG_MMA), ("W2_CONFIG_MMA", W2_CONFIG_MMA)) if use_mma else ():
        if c.block_n % 16 or not 16 <= c.block_n <= 512 or c.block_k % 128 or c.block_k < 128:
            _fail(name, "block_n a multiple of 16 up to 512 (16 rows a warp), block_k a multiple of 128",
                  f"block_n {c.block_n}, block_k {c.block_k}", "see moe_mxfp4_mma, \"lanes and fragments\"")
    has_shared = shared_b is not None
    native = native_fp8_supported(x.device) if native_fp8 is None else bool(native_fp8)
    native = native and has_shared and all(t.dtype == torch.float8_e4m3fn for t in shared[0:6:2])
    if has_shared:
        sw1b, ss1b, sw3b, ss3b, sw2b, ss2b = shared_b
        if native:
            sw1b, sw3b, sw2b = shared[0], shared[4], shared[2]
    else:  # never read: the grid has no shared slot; any byte tensors of the kernel's types
        sw1b, ss1b, sw3b, ss3b, sw2b, ss2b = w1b, s1b, w3b, s3b, w2b, s2b
    act, part, *table, split_part, arrivals = carve(workspace, x.device,
                                                   moe_mxfp4_parts(b, top_k, inter, d, x.dtype, grouped, has_shared))
    if (one_row or use_mma) and act.data_ptr() % 16:  # w2 reads its rows as x (inter % 32 == 0: every row aligned)
        _fail("workspace alignment", "16 bytes", f"address mod 16 {act.data_ptr() % 16}",
              "carve it at a 16-byte boundary, as the arena does")
    c13, c2 = (W13_CONFIG, W2_CONFIG) if b == 1 else (W13_CONFIG_BATCHED, W2_CONFIG_BATCHED)
    dot13 = c13.use_dot or b > 1 or not bf16  # the FMA loops read x (w13) and act (w2) as bf16 pairs
    dot2 = c2.use_dot or b > 1 or not bf16
    block_b = batch_block(b)
    slots = b * top_k + (1 if has_shared else 0)
    topk_pad = next_pow2(top_k)
    interp = interpreting()
    pdl = pdl_args(x.device)
    s13 = ss1b.stride(0)
    s2 = ss2b.stride(0)
    limit = float(swiglu_limit)

    def w13():
        bn = min(c13.block_n, max(16 if dot13 else 1, next_pow2(inter)))
        bn = max(bn, 16) if dot13 else bn
        # A dot K tile lies in one FP8 scale block; an FMA one may be wide (see "MXFP4 words").
        bk = min(c13.block_k, FP8_BLOCK if dot13 else c13.block_k, max(MXFP4_BLOCK, next_pow2(d)))
        _w13_kernel[(triton.cdiv(inter, bn), slots)](
            x, idx, wts, w1b, s1b, w3b, s3b, sw1b, ss1b, sw3b, ss3b, act, b, d, inter, x.stride(0), s13, limit,
            TOPK=top_k, TOPK_PAD=topk_pad, BLOCK_N=bn, BLOCK_K=bk, BLOCK_B=block_b if dot13 else 1,
            SUB_K=min(bk, FP8_BLOCK), EVEN=d % bk == 0 and inter % bn == 0, GROUPED=grouped, USE_DOT=dot13,
            NATIVE=native, INTERP=interp,
            num_warps=c13.num_warps, num_stages=c13.num_stages, **pdl,
        )  # fmt: skip

    def w2_():
        bn = min(c2.block_n, max(16 if dot2 else 1, next_pow2(d)))
        bn = max(bn, 16) if dot2 else bn
        # >= 32: the flat loop needs whole K tiles
        bk = _pow2_dividing(inter, min(c2.block_k, FP8_BLOCK) if dot2 else c2.block_k)
        _w2_kernel[(triton.cdiv(d, bn),)](
            act, idx, w2b, s2b, sw2b, ss2b, out, b, d, inter, out.stride(0), s2,
            TOPK=top_k, BLOCK_N=bn, BLOCK_K=bk, BLOCK_B=block_b if dot2 else 1, SUB_K=min(bk, FP8_BLOCK),
            EVEN=d % bn == 0, HAS_SHARED=has_shared, ACCUMULATE=accumulate, USE_DOT=dot2, NATIVE=native,
            INTERP=interp,
            num_warps=c2.num_warps, num_stages=c2.num_stages, **pdl,
        )  # fmt: skip

    def w2_grouped():
        bn = max(16, min(c2.block_n, next_pow2(d)))
        bk = min(c2.block_k, FP8_BLOCK, max(MXFP4_BLOCK, next_pow2(inter)))
        _w2_grouped_kernel[(triton.cdiv(d, bn), slots)](
            act, idx, wts, w2b, s2b, sw2b, ss2b, part, b, d, inter, s2,
            TOPK=top_k, TOPK_PAD=topk_pad, BLOCK_N=bn, BLOCK_K=bk, BLOCK_B=block_b, NATIVE=native, INTERP=interp,
            num_warps=c2.num_warps, num_stages=c2.num_stages, **pdl,
        )  # fmt: skip

    def reduce():
        block_d = min(REDUCE_BLOCK_D, next_pow2(d))
        _moe_reduce_kernel[(b, triton.cdiv(d, block_d))](
            part, idx, out, b, d, out.stride(0),
            TOPK=top_k, TOPK_PAD=topk_pad, BLOCK_D=block_d, HAS_SHARED=has_shared, ACCUMULATE=accumulate,
            num_warps=4, **pdl,
        )  # fmt: skip

    def mma_launches():
        from draftgraph.ops.triton import moe_mxfp4_mma as M

        c13, c2 = W13_CONFIG_MMA, W2_CONFIG_MMA
        split, tiles = mma_split(b, inter, d, x.dtype, grouped)
        # A part of w13's K: whole 128-column chunks (its FP8 scale blocks too), D split as evenly.
        k_part = triton.cdiv(triton.cdiv(d, 128), split) * 128
        # 16 rows a warp; K tiles of whole 128-column chunks (4 scale blocks, one a lane), a part a
        # whole number of them (the last one may be ragged: D's end)
        bk13 = min(c13.block_k, max(128, next_pow2(d)))
        while split > 1 and k_part % bk13:
            bk13 //= 2
        bk2 = min(c2.block_k, max(128, next_pow2(inter)))
        chunk = mma_chunk_rows(b)
        common = dict(TOPK=top_k, TOPK_PAD=topk_pad, BLOCK_B=block_b, CHUNK=chunk, NATIVE=native, INTERP=interp)
        rebias13, rebias2 = rebias if rebias is not None else (rebias_fits(w1_scale, w3_scale), rebias_fits(w2_scale))

        def rows():
            M.launch_rows((b * top_k,), idx, wts, *table, arrivals, b, tiles, TOPK=top_k, TOPK_PAD=topk_pad,
                          BLOCK_R=next_pow2(b), NPID_PAD=next_pow2(tiles) if split > 1 else 0, CHUNK=chunk, num_warps=1,
                          **pdl)  # fmt: skip

        def w13_mma():
            M.launch_w13(
                (triton.cdiv(inter, c13.block_n) * split, slots),
                x, idx, *table, w1b, s1b, w3b, s3b, sw1b, ss1b, sw3b, ss3b, act, split_part, arrivals, b, d, inter,
                x.stride(0), s13, limit, k_part,
                BLOCK_N=c13.block_n, BLOCK_K=bk13, DOT_K=min(FP8_BLOCK, max(16, next_pow2(min(d, k_part)))),
                SPLIT=split, EVEN=d % bk13 == 0, REBIASED=rebias13, **common, num_warps=c13.block_n // 16,
                num_stages=c13.num_stages,
                **pdl,
            )  # fmt: skip

        def w2_mma():
            M.launch_w2(
                (triton.cdiv(d, c2.block_n), slots),
                act, idx, *table, w2b, s2b, sw2b, ss2b, part, b, d, inter, s2,
                BLOCK_N=c2.block_n, BLOCK_K=bk2, DOT_K=min(FP8_BLOCK, max(16, next_pow2(inter))),
                EVEN=inter % bk2 == 0, REBIASED=rebias2, **common, num_warps=c2.block_n // 16,
                num_stages=c2.num_stages, **pdl, **({} if interp else {"maxnreg": W2_MMA_MAXNREG}),
            )  # fmt: skip

        return [("rows", rows), ("w13", w13_mma), ("w2", w2_mma), ("reduce", reduce)]

    if use_mma:
        return mma_launches()
    if grouped:
        return [("w13", w13), ("w2", w2_grouped), ("reduce", reduce)]
    return [("w13", w13), ("w2", w2_)]


def moe_mxfp4(
    x: torch.Tensor,
    idx: torch.Tensor,
    wts: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    out: torch.Tensor,
    *,
    swiglu_limit: float,
    shared: tuple[torch.Tensor, ...] | None = None,
    accumulate: bool = False,
    workspace: torch.Tensor | None = None,
    grouped: bool | None = None,
    native_fp8: bool | None = None,
    rebias: tuple[bool, bool] | None = None,
) -> None:
    """out[B, D] (+)= sum_k w2[e_bk] (wts[b, k] * swiglu(w1[e_bk] x_b, w3[e_bk] x_b)) (+ the shared expert).

    Parameters
    ----------
    x : bf16 / fp16 [B, D], B <= 64.
    idx, wts : [B, K] int32 expert ids and fp32 routing weights (the route kernel's), on the device; a
        negative id (``moe.NO_EXPERT``) is a pair to skip: no expert bytes read, nothing added.
    w1, w3 : MXFP4 [E, I, D/2] (int8 / uint8 / float4_e2m1fn_x2), scales [E, I, D/32] (UE8M0 or uint8).
    w2 : MXFP4 [E, D, I/2], scale [E, D, I/32].
    shared : (sw1, sw1_scale, sw2, sw2_scale, sw3, sw3_scale), FP8 e4m3 [I, D] / [D, I] with 128 x 128
        UE8M0 scales, or None (then only the routed experts).
    swiglu_limit : the clamp: silu(min(g, limit)) * clamp(u, -limit, limit).
    accumulate : add into out instead of overwriting it.
    workspace : uint8 scratch of :func:`moe_mxfp4_workspace` bytes (allocated when None or short).
    grouped : expert-major (each chosen expert read once for all its rows); default from B >= 2.
    rebias : (w1 and w3, w2): whether each one's scale bytes are all at most 128, for the tensor-core
        kernels' one-multiply decode (moe_mxfp4_mma, note "rebiased scale"); None: asked of the
        scales here (:func:`rebias_fits`, a device read a call: an op passes what its weights keep).

    Example
    -------
    >>> moe_mxfp4(x, idx, wts, w1, s1, w2, s2, w3, s3, out, swiglu_limit=10.0, shared=(sw1, ss1, sw2, ss2, sw3, ss3))
    """
    for _, launch in moe_mxfp4_launches(
        x, idx, wts, w1, w1_scale, w2, w2_scale, w3, w3_scale, out,
        swiglu_limit=swiglu_limit, shared=shared, accumulate=accumulate, workspace=workspace, grouped=grouped,
        native_fp8=native_fp8, rebias=rebias,
    ):  # fmt: skip
        launch()


def moe_mxfp4_bytes(top_k: int, d: int, inter: int, distinct_experts: int | None = None, shared: bool = True) -> int:
    """The weight bytes one call must read: each chosen expert's three MXFP4 matrices and scales once
    (``distinct_experts``: the number of different experts the batch chose; top_k for one row), and
    the FP8 shared expert once."""
    per_expert = 3 * (inter * d // 2 + inter * d // MXFP4_BLOCK)
    fp8 = 0
    if shared:
        r, c = fp8_scale_shape((inter, d))
        fp8 = 3 * inter * d + 3 * r * c
    return (top_k if distinct_experts is None else distinct_experts) * per_expert + fp8
