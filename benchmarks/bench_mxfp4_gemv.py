"""Batch-1 MXFP4 GEMV variants for the MoE's w13 step, side by side (one GPU, one call).

    python benchmarks/bench_mxfp4_gemv.py [--experts 6] [--n 2048] [--k 4096] [--out DIR]
    python benchmarks/bench_mxfp4_gemv.py --interpret --n 64 --k 256 --experts 2   # CPU: correctness only
    python benchmarks/bench_mxfp4_gemv.py --compile-only 90 [--sass DIR]            # CPU: SASS of each, no run

Each kernel computes, for ``experts`` experts (grid dim 1), g = W1 x and u = W3 x (fp32 [N] each)
with W1, W3 MXFP4 [N, K] (``moe_mxfp4``'s format: [N, K/2] bytes, the even column in the low
nibble, UE8M0 scales [N, K/32]) and x bf16 [K]: the routed part of ``moe_mxfp4._w13_kernel`` at
batch 1 (no SwiGLU, no shared expert). The variants:

- ``current``: ``_expert_tiles_fma`` twice (g, then u), as ``_w13_kernel`` does.
- ``paired``: one K loop, ``mxfp4_fma`` on the w1 and the w3 tile of the same rows each
  iteration (two accumulators): twice the bytes in flight per iteration.
- ``prefetch``: paired, with the next iteration's words and scales loaded before the current
  ones are decoded (loop-carried tensors: register double-buffering by hand; it holds in the
  SASS here, where the loop's BARs keep ptxas from moving the loads, but see "ptxas sinks the
  prefetch").
- ``bcast_act``: paired, the activation's four bf16 pairs of a word loaded by the thread that
  holds the word (one ``ld.global.nc.v4``, inline PTX, on pointers in the words' layout), and
  the scales the same way (``ld.global.nc.u8``): no layout conversion, so no BAR/LDS in the loop.
  The tile is [blocks, rows, 4 words] (``COAL``): Triton orders a layout's dimensions by
  contiguity, ties by index, so [rows, blocks, 4 words] (``mxfp4_fma``'s, and ``current``'s)
  puts a warp's lanes along the rows: 16 (or 8) bytes of a row per lane and load, the other half
  of each 32-byte sector read by another warp; [blocks, rows, 4] puts them along a row's blocks
  (128 contiguous bytes). ``bcast_rowlanes``: bcast_act in the rows-first tile, for comparison.
- ``f16``: bcast_act with the codes decoded into fp16 bits (see "e2m1 as fp16") and converted
  to fp32 by the hardware, the 2^14 folded into the block scale: no bf16x2 multiply, no
  integer extraction of the weights' halves (scale bytes up to 240). ``f16_pf``: with prefetch
  (paired + prefetch + f16). ``f16_pipe``: the loop as ``tl.range(num_stages=3)``, which makes
  Triton 3.6 pipeline the words' loads (cp.async through shared memory, 2 tiles ahead; 2 BAR an
  iteration). ``f16_l2``: each iteration prefetches into L2 (``prefetch.global.L2``) the words and
  scales 1024 columns ahead; ``f16_pipe_l2``: both.
- ``mma``: tensor cores, ``mma.sync.m16n8k16`` bf16 by inline PTX with the decoded weights as A
  and the activation as B (all 8 columns the same), each lane's fragments loaded by the lane
  itself: no FMAs and no fp32 extraction of either operand's halves (the note above
  MMA_WORDS_PTX). ``mma_fold``: the 2^126 rebias split between the scale multiply and the
  activation (one bf16x2 op a pair of codes less; scale bytes up to 191). ``mma_fold_l2``: with
  the L2 prefetch 1024 columns ahead.

Note "ptxas sinks the prefetch": in a loop with no BAR (``f16_pf``), Triton emits the next tile's
loads before the current tile's decode (in the PTX too), but ptxas moves them below it: the
loop's SASS ends with the loads, whose registers the decode at its top reads, so each tile is
issued just before its use, as in the plain loop. A branch around the loads (a block of their
own) and a ``bar.warp.sync`` after them did not stop it (tried on sm_90, Triton 3.6's ptxas).
Pipelining that holds needs shared memory (``f16_pipe``) or the L2 (``f16_l2``).

Timing: a CUDA graph of R back-to-back launches, each over all ``experts`` experts of one of
``SETS`` weight sets (so consecutive launches read different bytes, ``SETS`` x the L2), replayed
ROUNDS times, the median per launch; against the best device-to-device copy bandwidth of
``bench_kernels.copy_bandwidth``'s three ways (read + written bytes). Every variant's g and u
are checked against a torch fp32 dequantisation of every set. Per kernel also: registers a
thread, whether its SASS has BAR in a loop, and the loops' SASS instructions per code (all
innermost loops' instructions over the codes a thread decodes in one iteration of each).

Note "e2m1 as fp16" (``E2M1_F16_PTX``): a code s e1 e0 m placed as the fp16 bits s at 15, e1 e0 m
at 11..9 is the value times 2^-14 (e = 0: an fp16 subnormal, exact). One integer multiply of the
nibble cannot place it as ``E2M1_WORD_PTX`` does for bf16: the sign needs a shift by 12, the
magnitude one by 9, and the two copies of the nibble overlap at bit 12 (code 15, -6, carries into
the sign; no multiplier m = 1 mod 8 gives both the low 3 bits and bit 6 of c * m right for all 16
codes). So the word is rearranged once: a = each byte's low code as the fp16 high byte
(magnitude << 1 | sign << 7), b = the high codes the same way; then one byte permute with zero
per pair of codes (two low or two high codes: columns 2j, 2j + 2 or 2j + 1, 2j + 3) and the
hardware f16 -> f32 conversions, 8 + 4 + 8 instructions a word (bf16: 3 + 16, then 8 integer ops
to split the pairs into fp32).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
elif "--compile-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"


def _use_this_tree() -> None:
    """Import ``draftgraph`` from the tree this script is in (a folder holding only a link to it, first
    on the path), not from wherever it is installed, unless it already resolves there."""
    import atexit
    import importlib.util
    import shutil

    root = Path(__file__).resolve().parent.parent
    if not (root / "__init__.py").exists() or not (root / "ops" / "triton" / "moe_mxfp4.py").exists():
        return
    spec = importlib.util.find_spec("draftgraph")
    if spec is not None and spec.origin and Path(spec.origin).resolve().parent == root:
        return
    link_dir = Path(tempfile.mkdtemp(prefix="draftgraph_link_"))
    atexit.register(shutil.rmtree, link_dir, ignore_errors=True)
    (link_dir / "draftgraph").symlink_to(root)
    sys.path.insert(0, str(link_dir))


_use_this_tree()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from draftgraph.ops.triton.fp8_linear import ue8m0_to_f32  # noqa: E402
from draftgraph.ops.triton.moe_mxfp4 import _expert_tiles_fma, _hi, _lo, e2m1_word_pairs, mxfp4_fma  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
SETS = 4  # weight sets cycled through by consecutive launches (4 x 53 MB at V4 shapes: past the L2)
REPS = 20  # launches per captured graph
ROUNDS = 15  # graph replays timed
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# ---- decoding -------------------------------------------------------------------------------

# One int32 word of 8 e2m1 codes -> its 8 values times 2^-14 as fp32, in column order (see "e2m1 as
# fp16"). $8: the word; $0..$7: columns 0..7.
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
F16_REBIAS = 16384.0  # 2^14, folded into the block scale


@triton.jit
def _e2m1_scaled(c):
    """e2m1 codes (int32 0..15) -> their values times 2^-14 (exact in fp32)."""
    mag = c & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0)))
    return tl.where((c & 8) != 0, -v, v) * 0.00006103515625


@triton.jit
def e2m1_word_f16(w, INTERP: tl.constexpr):
    """int32 words of 8 e2m1 codes -> 8 fp32 tensors: columns 0..7, each value times 2^-14."""
    if INTERP:  # the interpreter runs no PTX: the same values by arithmetic
        return (_e2m1_scaled(w & 15), _e2m1_scaled(w >> 4 & 15), _e2m1_scaled(w >> 8 & 15),
                _e2m1_scaled(w >> 12 & 15), _e2m1_scaled(w >> 16 & 15), _e2m1_scaled(w >> 20 & 15),
                _e2m1_scaled(w >> 24 & 15), _e2m1_scaled(w >> 28 & 15))  # fmt: skip
    else:
        return tl.inline_asm_elementwise(E2M1_F16_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _ld_v4(ptr, INTERP: tl.constexpr):
    """Four int32 from ptr (int32 pointers, 16-byte aligned), loaded by the thread that holds the pointer."""
    if INTERP:
        return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _ld_u8(ptr, INTERP: tl.constexpr):
    """One byte from ptr (uint8 pointers) as int32, loaded by the thread that holds the pointer."""
    if INTERP:
        return tl.load(ptr).to(tl.int32)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True,
                                         pack=1)  # fmt: skip


PREFETCH_L2_PTX = tl.constexpr("""
{
prefetch.global.L2 [$1];
mov.b32 $0, 0;
}
""")


@triton.jit
def _prefetch_l2(ptr, INTERP: tl.constexpr):
    """Bring the line of each pointer into L2 (no register written; the interpreter skips it)."""
    if not INTERP:
        tl.inline_asm_elementwise(PREFETCH_L2_PTX, "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)


# ---- kernels --------------------------------------------------------------------------------
# All: grid (N / BLOCK_N, experts); expert e0 + program_id(1) of a [*, N, K/2] stack; g, u fp32 [*, N].
# BLOCK_N divides N and BLOCK_K divides K (the host checks); only `current` and `paired` mask.


@triton.jit(do_not_specialize=["e0"])
def k_current(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, g_ptr, u_ptr, e0, N, K,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    e = (e0 + tl.program_id(1)).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    n64 = offs_n.to(tl.int64)
    w_off = e * N * (K // 8) + n64 * (K // 8)
    s_off = e * N * (K // 32) + n64 * (K // 32)
    w1 = w1_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    w3 = w3_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    g = _expert_tiles_fma(x_ptr, w1 + w_off, s1_ptr + s_off, n_mask, K, K, False, BLOCK_N, BLOCK_K, 128, True,
                          False, INTERP)  # fmt: skip
    u = _expert_tiles_fma(x_ptr, w3 + w_off, s3_ptr + s_off, n_mask, K, K, False, BLOCK_N, BLOCK_K, 128, True,
                          False, INTERP)  # fmt: skip
    out = (e * N + n64)[:, None]
    tl.store(g_ptr + out, g, mask=n_mask[:, None])
    tl.store(u_ptr + out, u, mask=n_mask[:, None])


@triton.jit(do_not_specialize=["e0"])
def k_paired(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, g_ptr, u_ptr, e0, N, K,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    e = (e0 + tl.program_id(1)).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    n64 = offs_n.to(tl.int64)
    w_off = tl.multiple_of(e * N * (K // 8) + n64 * (K // 8), 4)  # K % 32 == 0: rows start on 16 bytes
    s_off = e * N * (K // 32) + n64 * (K // 32)
    w1 = w1_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_off
    w3 = w3_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_off
    a_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc1 = mxfp4_fma(acc1, w1, s1_ptr + s_off, a_words, True, k0, n_mask, K, BLOCK_K, INTERP)
        acc3 = mxfp4_fma(acc3, w3, s3_ptr + s_off, a_words, True, k0, n_mask, K, BLOCK_K, INTERP)
    out = e * N + n64
    tl.store(g_ptr + out, tl.sum(tl.sum(acc1, 2), 1), mask=n_mask)
    tl.store(u_ptr + out, tl.sum(tl.sum(acc3, 2), 1), mask=n_mask)


@triton.jit
def _act_split(a_words, k0, BLOCK_K: tl.constexpr):
    """The activation's bf16 pairs of the tile's words, as mxfp4_fma loads them: 4 x [NB, 4] (converted)."""
    NB: tl.constexpr = BLOCK_K // 32
    kw = k0 // 8 + tl.arange(0, NB)[:, None] * 4 + tl.arange(0, 4)[None, :]
    pairs = tl.load(a_words + kw[:, :, None] * 4 + tl.arange(0, 4)[None, None, :])
    a02, a13 = tl.split(tl.reshape(pairs, [NB, 4, 2, 2]))
    a0, a2 = tl.split(a02)
    a1, a3 = tl.split(a13)
    return a0[None, :, :], a1[None, :, :], a2[None, :, :], a3[None, :, :]


@triton.jit
def _load_tile(w_rows, s_rows, a_words, k0, blocks, words, ACT_ASM: tl.constexpr, INTERP: tl.constexpr):
    """One K tile of two matrices, 3D in the tile's orientation (rows x blocks x 4 words, or blocks x rows
    x 4 words: COAL): words x 2, scales x 2 ([.., .., 1]) and, ACT_ASM, the activation's 4 pairs of each
    word ([.., .., 4] with 1 along the rows: broadcast), loaded by the thread that holds the word."""
    kw = k0 // 8 + blocks * 4 + words  # word columns
    w1 = tl.load(w_rows[0] + kw)
    w3 = tl.load(w_rows[1] + kw)
    if ACT_ASM:
        s1 = _ld_u8(s_rows[0] + (k0 // 32 + blocks), INTERP)
        s3 = _ld_u8(s_rows[1] + (k0 // 32 + blocks), INTERP)
        a0, a1, a2, a3 = _ld_v4(a_words + kw * 4, INTERP)
    else:
        s1 = tl.load(s_rows[0] + (k0 // 32 + blocks))
        s3 = tl.load(s_rows[1] + (k0 // 32 + blocks))
        a0 = tl.zeros_like(kw)  # loaded at use (_act_split)
        a1, a2, a3 = a0, a0, a0
    return w1, w3, s1, s3, a0, a1, a2, a3


@triton.jit
def _words_dot(acc, w, s, a0, a1, a2, a3, F16: tl.constexpr, INTERP: tl.constexpr):
    """acc += each word's 8 codes times their activation columns, times the block scale (s: UE8M0 bytes)."""
    if F16:
        c0, c1, c2, c3, c4, c5, c6, c7 = e2m1_word_f16(w, INTERP)
        part = c0 * _lo(a0)
        part += c1 * _hi(a0)
        part += c2 * _lo(a1)
        part += c3 * _hi(a1)
        part += c4 * _lo(a2)
        part += c5 * _hi(a2)
        part += c6 * _lo(a3)
        part += c7 * _hi(a3)
        scale = ue8m0_to_f32(s) * 16384.0  # F16_REBIAS
    else:
        p0, p1, p2, p3 = e2m1_word_pairs(w, INTERP)
        part = _lo(p0) * _lo(a0)
        part += _hi(p0) * _hi(a0)
        part += _lo(p1) * _lo(a1)
        part += _hi(p1) * _hi(a1)
        part += _lo(p2) * _lo(a2)
        part += _hi(p2) * _hi(a2)
        part += _lo(p3) * _lo(a3)
        part += _hi(p3) * _hi(a3)
        scale = ue8m0_to_f32(s)
    return acc + part * scale


@triton.jit(do_not_specialize=["e0"])
def k_tiles(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, g_ptr, u_ptr, e0, N, K,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, ACT_ASM: tl.constexpr,
            F16: tl.constexpr, COAL: tl.constexpr, STAGES: tl.constexpr, L2_AHEAD: tl.constexpr,
            INTERP: tl.constexpr):  # fmt: skip
    """Paired tiles on their own loads. PREFETCH: the next tile loaded before this one is decoded
    (register double-buffering; see "ptxas sinks the prefetch"). ACT_ASM: activation and scales loaded
    in the words' layout. F16: the fp16 decode. COAL: the tile as blocks x rows x words (see
    ``bcast_act``; needs ACT_ASM). STAGES > 1: the loop as tl.range(num_stages=STAGES): Triton's
    pipeliner turns the words' loads into cp.async through shared memory, STAGES - 1 tiles ahead.
    L2_AHEAD > 0: each iteration also prefetches into L2 (prefetch.global.L2) the words and scales
    L2_AHEAD columns ahead."""
    NB: tl.constexpr = BLOCK_K // 32
    e = (e0 + tl.program_id(1)).to(tl.int64)
    n64 = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    w_off = tl.multiple_of(e * N * (K // 8) + n64 * (K // 8), 4)  # K % 32 == 0: rows start on 16 bytes
    s_off = e * N * (K // 32) + n64 * (K // 32)
    words = tl.arange(0, 4)[None, None, :]
    if COAL:
        w_off = w_off[None, :, None]
        s_off = s_off[None, :, None]
        blocks = tl.arange(0, NB)[:, None, None]
        acc1 = tl.zeros([NB, BLOCK_N, 4], dtype=tl.float32)
    else:
        w_off = w_off[:, None, None]
        s_off = s_off[:, None, None]
        blocks = tl.arange(0, NB)[None, :, None]
        acc1 = tl.zeros([BLOCK_N, NB, 4], dtype=tl.float32)
    acc3 = tl.zeros_like(acc1)
    w_rows = (w1_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_off,
              w3_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_off)  # fmt: skip
    s_rows = (s1_ptr + s_off, s3_ptr + s_off)
    a_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if PREFETCH:
        w1, w3, s1, s3, a0, a1, a2, a3 = _load_tile(w_rows, s_rows, a_words, 0, blocks, words, ACT_ASM, INTERP)
        for k0 in range(0, K, BLOCK_K):
            # the last iteration reloads its own tile (cached)
            kn = tl.multiple_of(tl.minimum(k0 + BLOCK_K, K - BLOCK_K), BLOCK_K)
            w1n, w3n, s1n, s3n, a0n, a1n, a2n, a3n = _load_tile(w_rows, s_rows, a_words, kn, blocks, words, ACT_ASM,
                                                                INTERP)  # fmt: skip
            if not ACT_ASM:
                a0, a1, a2, a3 = _act_split(a_words, k0, BLOCK_K)
            acc1 = _words_dot(acc1, w1, s1, a0, a1, a2, a3, F16, INTERP)
            acc3 = _words_dot(acc3, w3, s3, a0, a1, a2, a3, F16, INTERP)
            w1, w3, s1, s3, a0, a1, a2, a3 = w1n, w3n, s1n, s3n, a0n, a1n, a2n, a3n
    else:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            if L2_AHEAD > 0:
                kp = tl.minimum(k0 + L2_AHEAD, K - BLOCK_K)
                _prefetch_l2(w_rows[0] + (kp // 8 + blocks * 4), INTERP)
                _prefetch_l2(w_rows[1] + (kp // 8 + blocks * 4), INTERP)
                _prefetch_l2(s_rows[0] + (kp // 32 + blocks), INTERP)
                _prefetch_l2(s_rows[1] + (kp // 32 + blocks), INTERP)
            w1, w3, s1, s3, a0, a1, a2, a3 = _load_tile(w_rows, s_rows, a_words, k0, blocks, words, ACT_ASM, INTERP)
            if not ACT_ASM:
                a0, a1, a2, a3 = _act_split(a_words, k0, BLOCK_K)
            acc1 = _words_dot(acc1, w1, s1, a0, a1, a2, a3, F16, INTERP)
            acc3 = _words_dot(acc3, w3, s3, a0, a1, a2, a3, F16, INTERP)
    out = e * N + n64
    if COAL:
        g = tl.sum(tl.sum(acc1, 2), 0)
        u = tl.sum(tl.sum(acc3, 2), 0)
    else:
        g = tl.sum(tl.sum(acc1, 2), 1)
        u = tl.sum(tl.sum(acc3, 2), 1)
    tl.store(g_ptr + out, g)
    tl.store(u_ptr + out, u)


# ---- the tensor-core variant ------------------------------------------------------------------
# m16n8k16 bf16 mma.sync with the weights as A (16 rows: each lane group g = lane / 4 holds rows g and
# g + 8 of its warp's 16) and the activation as B (all 8 columns the same), so C[m, n] is row m's dot
# for every n: lane (g, t) ends with row g in c0 (and c1) and row g + 8 in c2 (and c3). Lane t = lane % 4
# holds block t of each 4 consecutive scale blocks (16 bytes a row: one ld.v4) of both its rows; one
# word of each row, decoded to bf16x2 pairs (E2M1_WORD_PTX's steps) times the block scale (exact: a
# power of two), is A's four registers of 2 mmas (pairs 0, 1, then 2, 3, at k slots t and t + 4); the
# activation's pairs of the same word are B's two registers. Every lane with the same t holds the
# same columns, as the mma's k indices require. Each tensor below has one element a thread (1D,
# 32 x warps: Triton's layout puts element i on thread i) and every load and store is inline PTX (no
# layout anchors), so the element a lane holds is the one its index says.
MMA_WORDS_PTX = tl.constexpr("""
{
.reg .b32 lo, hi, t, r, z, a0, a1, a2, a3, b0, b1, b2, b3;
mov.b32 r, 0x7E807E80;
mov.b32 z, 0x80008000;
and.b32 lo, $4, 0x0F0F0F0F;
shr.u32 hi, $4, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, hi, 0x8480;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 a0, t, $6, z;
prmt.b32 t, lo, hi, 0x8581;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 a1, t, $6, z;
prmt.b32 t, lo, hi, 0x8682;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 a2, t, $6, z;
prmt.b32 t, lo, hi, 0x8783;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 a3, t, $6, z;
and.b32 lo, $5, 0x0F0F0F0F;
shr.u32 hi, $5, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, hi, 0x8480;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 b0, t, $7, z;
prmt.b32 t, lo, hi, 0x8581;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 b1, t, $7, z;
prmt.b32 t, lo, hi, 0x8682;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 b2, t, $7, z;
prmt.b32 t, lo, hi, 0x8783;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, r, z;
fma.rn.bf16x2 b3, t, $7, z;
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {a0, b0, a1, b1}, {$8, $9}, {$12, $13, $14, $15};
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {a2, b2, a3, b3}, {$10, $11}, {$0, $1, $2, $3};
}
""")


# FOLD: the rebias 2^126 split as 2^63 into the weights' scale multiply (one bf16x2 multiply a pair,
# by 2^63 x scale: fits bf16 for UE8M0 bytes <= 191) and 2^63 into the activation (once a pair of
# activation columns, shared by both rows and both matrices). The products are still exact.
MMA_WORDS_FOLD_PTX = tl.constexpr(
    "\n".join(
        line
        for line in MMA_WORDS_PTX.value.splitlines()
        if line not in ("fma.rn.bf16x2 t, t, r, z;", "mov.b32 r, 0x7E807E80;")
    )
)
ACT_REBIAS_PTX = tl.constexpr("""
{
.reg .b32 c, z;
mov.b32 c, 0x5F005F00;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, $4, c, z;
fma.rn.bf16x2 $1, $5, c, z;
fma.rn.bf16x2 $2, $6, c, z;
fma.rn.bf16x2 $3, $7, c, z;
}
""")


@triton.jit
def _act_rebias(x0, x1, x2, x3, FOLD: tl.constexpr, INTERP: tl.constexpr):
    """FOLD: the activation pairs times 2^63 (exact), else as they are."""
    if FOLD and not INTERP:
        return tl.inline_asm_elementwise(ACT_REBIAS_PTX, "=r,=r,=r,=r,r,r,r,r", [x0, x1, x2, x3],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)  # fmt: skip
    else:
        return x0, x1, x2, x3


@triton.jit
def _mma_words(c0, c1, c2, c3, wa, wb, sca, scb, sa, sb, x0, x1, x2, x3, FOLD: tl.constexpr, INTERP: tl.constexpr):
    """C += one word of row g (wa) and of row g + 8 (wb), each times its block scale (sca / scb: bf16x2
    bits; sa / sb: UE8M0 bytes), times the activation pairs x0..x3 of their columns: 2 mma.sync (see
    MMA_WORDS_PTX). INTERP: c0 / c2 += this lane's own products for row g / g + 8 (the 4 lanes of a
    row are summed at the end; c1, c3 unused)."""
    if INTERP:
        p0, p1, p2, p3 = e2m1_word_pairs(wa, INTERP)
        pa = _lo(p0) * _lo(x0) + _hi(p0) * _hi(x0) + _lo(p1) * _lo(x1) + _hi(p1) * _hi(x1)
        pa += _lo(p2) * _lo(x2) + _hi(p2) * _hi(x2) + _lo(p3) * _lo(x3) + _hi(p3) * _hi(x3)
        q0, q1, q2, q3 = e2m1_word_pairs(wb, INTERP)
        pb = _lo(q0) * _lo(x0) + _hi(q0) * _hi(x0) + _lo(q1) * _lo(x1) + _hi(q1) * _hi(x1)
        pb += _lo(q2) * _lo(x2) + _hi(q2) * _hi(x2) + _lo(q3) * _lo(x3) + _hi(q3) * _hi(x3)
        return c0 + pa * ue8m0_to_f32(sa), c1, c2 + pb * ue8m0_to_f32(sb), c3
    else:
        return tl.inline_asm_elementwise(MMA_WORDS_FOLD_PTX if FOLD else MMA_WORDS_PTX,
                                         "=f,=f,=f,=f,r,r,r,r,r,r,r,r,f,f,f,f",
                                         [wa, wb, sca, scb, x0, x1, x2, x3, c0, c1, c2, c3],
                                         dtype=(tl.float32,) * 4, is_pure=True, pack=1)  # fmt: skip


ST_PTX = tl.constexpr("""
{
.reg .pred p;
setp.ne.b32 p, $3, 0;
@p st.global.b32 [$1], $2;
mov.b32 $0, 0;
}
""")


@triton.jit
def _st_f32(ptr, v, live, INTERP: tl.constexpr):
    """ptr[i] = v[i] where live, each by the thread that holds it."""
    if INTERP:
        tl.store(ptr, v, mask=live)
    else:
        tl.inline_asm_elementwise(ST_PTX, "=r,l,r,r", [ptr.to(tl.int64), v.to(tl.int32, bitcast=True),
                                  live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _scale_pair(s, FOLD: tl.constexpr):
    """UE8M0 bytes (int32) -> the scale as bf16 in both halves (moe_mxfp4._scale_bf16's bits); FOLD: times
    2^63 (bytes <= 191)."""
    if FOLD:
        bits = (s + 63) << 7
    else:
        bits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7))
    return bits | bits << 16


@triton.jit
def _mma_act(a_words, bt, FOLD: tl.constexpr, INTERP: tl.constexpr):
    """The activation pairs of a lane's block bt: 4 words x 4 pairs (FOLD: times 2^63)."""
    x0, x1, x2, x3 = _act_rebias(*_ld_v4(a_words + bt * 16, INTERP), FOLD, INTERP)
    x4, x5, x6, x7 = _act_rebias(*_ld_v4(a_words + bt * 16 + 4, INTERP), FOLD, INTERP)
    x8, x9, x10, x11 = _act_rebias(*_ld_v4(a_words + bt * 16 + 8, INTERP), FOLD, INTERP)
    x12, x13, x14, x15 = _act_rebias(*_ld_v4(a_words + bt * 16 + 12, INTERP), FOLD, INTERP)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _mma_chunk(c0, c1, c2, c3, wa_row, wb_row, sa_row, sb_row, x, bt, FOLD: tl.constexpr, INTERP: tl.constexpr):
    """One lane's block bt of its two rows (g, g + 8) of one matrix: 2 x 4 words, 8 mma.sync (x: _mma_act)."""
    a0, a1, a2, a3 = _ld_v4(wa_row + bt * 4, INTERP)
    b0, b1, b2, b3 = _ld_v4(wb_row + bt * 4, INTERP)
    sa = _ld_u8(sa_row + bt, INTERP)
    sb = _ld_u8(sb_row + bt, INTERP)
    sca = _scale_pair(sa, FOLD)
    scb = _scale_pair(sb, FOLD)
    c0, c1, c2, c3 = _mma_words(c0, c1, c2, c3, a0, b0, sca, scb, sa, sb, x[0], x[1], x[2], x[3], FOLD, INTERP)
    c0, c1, c2, c3 = _mma_words(c0, c1, c2, c3, a1, b1, sca, scb, sa, sb, x[4], x[5], x[6], x[7], FOLD, INTERP)
    c0, c1, c2, c3 = _mma_words(c0, c1, c2, c3, a2, b2, sca, scb, sa, sb, x[8], x[9], x[10], x[11], FOLD, INTERP)
    c0, c1, c2, c3 = _mma_words(c0, c1, c2, c3, a3, b3, sca, scb, sa, sb, x[12], x[13], x[14], x[15], FOLD, INTERP)
    return c0, c1, c2, c3


@triton.jit(do_not_specialize=["e0"])
def k_mma(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, g_ptr, u_ptr, e0, N, K,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD: tl.constexpr, L2_AHEAD: tl.constexpr,
          INTERP: tl.constexpr):  # fmt: skip
    """Tensor-core tiles: BLOCK_N = 16 rows a warp; BLOCK_K a multiple of 128 (4 blocks, one a lane);
    FOLD: see MMA_WORDS_FOLD_PTX; L2_AHEAD > 0: prefetch into L2 the lane's words and scales that many
    columns ahead."""
    W: tl.constexpr = BLOCK_N // 16
    tid = tl.arange(0, 32 * W)
    g = tid % 32 // 4
    t = tid % 4
    e = (e0 + tl.program_id(1)).to(tl.int64)
    base = tl.program_id(0) * BLOCK_N + (tid // 32) * 16  # the warp's first row
    ra = (base + g).to(tl.int64)  # this lane's rows: ra and ra + 8
    w1a = w1_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + e * N * (K // 8) + ra * (K // 8)
    w3a = w3_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + e * N * (K // 8) + ra * (K // 8)
    s1a = s1_ptr + e * N * (K // 32) + ra * (K // 32)
    s3a = s3_ptr + e * N * (K // 32) + ra * (K // 32)
    a_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    zero = tl.zeros([32 * W], dtype=tl.float32)
    g0, g1, g2, g3 = zero, zero, zero, zero
    u0, u1, u2, u3 = zero, zero, zero, zero
    for k0 in range(0, K, BLOCK_K):
        if L2_AHEAD > 0:
            kp = tl.minimum(k0 + L2_AHEAD, K - BLOCK_K)
            for c in tl.static_range(BLOCK_K // 128):
                bp = kp // 32 + c * 4 + t
                for row in tl.static_range(2):  # rows g and g + 8
                    _prefetch_l2(w1a + row * 8 * (K // 8) + bp * 4, INTERP)
                    _prefetch_l2(w3a + row * 8 * (K // 8) + bp * 4, INTERP)
                    _prefetch_l2(s1a + row * 8 * (K // 32) + bp, INTERP)
                    _prefetch_l2(s3a + row * 8 * (K // 32) + bp, INTERP)
        for c in tl.static_range(BLOCK_K // 128):
            bt = k0 // 32 + c * 4 + t  # this lane's block
            x = _mma_act(a_words, bt, FOLD, INTERP)
            g0, g1, g2, g3 = _mma_chunk(g0, g1, g2, g3, w1a, w1a + 8 * (K // 8), s1a, s1a + 8 * (K // 32), x, bt,
                                        FOLD, INTERP)  # fmt: skip
            u0, u1, u2, u3 = _mma_chunk(u0, u1, u2, u3, w3a, w3a + 8 * (K // 8), s3a, s3a + 8 * (K // 32), x, bt,
                                        FOLD, INTERP)  # fmt: skip
    if INTERP:  # each lane's own dots: the 4 lanes of a row summed
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, W)[:, None] * 16 + tl.arange(0, 8)[None, :]) + e * N
        tl.store(g_ptr + rows, tl.sum(tl.reshape(g0, [W, 8, 4]), 2))
        tl.store(g_ptr + rows + 8, tl.sum(tl.reshape(g2, [W, 8, 4]), 2))
        tl.store(u_ptr + rows, tl.sum(tl.reshape(u0, [W, 8, 4]), 2))
        tl.store(u_ptr + rows + 8, tl.sum(tl.reshape(u2, [W, 8, 4]), 2))
    else:  # lane (g, 0) stores rows g and g + 8 of its warp's 16
        out = e * N + ra
        first = t == 0
        _st_f32(g_ptr + out, g0, first, INTERP)
        _st_f32(g_ptr + out + 8, g2, first, INTERP)
        _st_f32(u_ptr + out, u0, first, INTERP)
        _st_f32(u_ptr + out + 8, u2, first, INTERP)


def _tiles(prefetch=False, act_asm=True, f16=False, coal=True, stages=1, l2_ahead=0) -> dict:
    return dict(PREFETCH=prefetch, ACT_ASM=act_asm, F16=f16, COAL=coal, STAGES=stages, L2_AHEAD=l2_ahead)


# (name, kernel, constexpr flags, [(BLOCK_N, BLOCK_K, num_warps)]): 22 kernels
VARIANTS = [
    ("current", k_current, {}, [(16, 256, 4), (4, 1024, 1)]),
    ("paired", k_paired, {}, [(16, 256, 4)]),
    ("prefetch", k_tiles, _tiles(prefetch=True, act_asm=False, coal=False), [(16, 256, 4)]),
    ("bcast_act", k_tiles, _tiles(), [(16, 256, 4), (4, 1024, 1)]),
    ("bcast_rowlanes", k_tiles, _tiles(coal=False), [(16, 256, 4)]),
    ("f16_pf", k_tiles, _tiles(prefetch=True, f16=True), [(16, 256, 4)]),
    ("f16", k_tiles, _tiles(f16=True), [(16, 256, 4), (4, 1024, 1), (32, 256, 4)]),
    ("f16_pipe", k_tiles, _tiles(f16=True, stages=3), [(16, 256, 4), (4, 1024, 1)]),
    ("f16_l2", k_tiles, _tiles(f16=True, l2_ahead=1024), [(16, 256, 4), (4, 1024, 1)]),
    ("f16_pipe_l2", k_tiles, _tiles(f16=True, stages=3, l2_ahead=1024), [(16, 256, 4)]),
    ("mma", k_mma, dict(FOLD=False, L2_AHEAD=0), [(16, 512, 1), (32, 256, 2)]),
    ("mma_fold", k_mma, dict(FOLD=True, L2_AHEAD=0), [(16, 512, 1), (32, 256, 2)]),
    ("mma_fold_l2", k_mma, dict(FOLD=True, L2_AHEAD=1024), [(16, 512, 1), (32, 256, 2)]),
]


# ---- host side ------------------------------------------------------------------------------


def dequant_mxfp4(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] bytes and [..., N, K/32] UE8M0 bytes -> fp32 [..., N, K] (even column: low nibble)."""
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float32, device=w.device)
    b = w.to(torch.int64)
    vals = torch.stack([table[b & 15], table[b >> 4]], dim=-1).flatten(-2)  # [..., N, K]
    scale = torch.exp2(s.to(torch.float32) - 127.0)
    return (vals.unflatten(-1, (-1, 32)) * scale[..., None]).flatten(-2)


def make_inputs(experts: int, n: int, k: int, sets: int, device: str, seed: int = 0):
    """x bf16 [K] and w1, s1, w3, s3 for experts x sets experts: random code bytes, scale bytes 120..134."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = experts * sets

    def codes():
        return torch.randint(0, 256, (total, n, k // 2), generator=g, dtype=torch.uint8, device=device)

    def scales():
        return torch.randint(120, 135, (total, n, k // 32), generator=g, dtype=torch.uint8, device=device)

    x = torch.randn(k, generator=g, dtype=torch.float32, device=device).to(torch.bfloat16)
    return x, codes(), scales(), codes(), scales()


def reference(x, w1, s1, w3, s3):
    """g, u fp32 [E, N] by fp32 dequantisation, one expert at a time."""
    xf = x.to(torch.float32)
    g = torch.stack([dequant_mxfp4(w1[e], s1[e]) @ xf for e in range(w1.shape[0])])
    u = torch.stack([dequant_mxfp4(w3[e], s3[e]) @ xf for e in range(w3.shape[0])])
    return g, u


def launcher(kernel, flags, cfg, x, w1, s1, w3, s3, g, u, experts: int, n: int, k: int):
    bn, bk, warps = cfg
    if n % bn or k % bk or k % 32:
        raise ValueError(f"tile {bn}x{bk} does not divide [{n}, {k}]")

    def launch(e0: int):
        return kernel[(n // bn, experts)](x, w1, s1, w3, s3, g, u, e0, n, k, BLOCK_N=bn, BLOCK_K=bk, INTERP=INTERP,
                                          num_warps=warps, num_stages=3, **flags)  # fmt: skip

    return launch


# ---- SASS -----------------------------------------------------------------------------------


def _nvidia_tool(name: str) -> str | None:
    try:
        from triton import knobs

        path = getattr(knobs.nvidia, name).path
        if path and os.path.exists(path):
            return path
    except Exception:
        pass
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")


def sass_stats(cubin: bytes, codes_per_iteration: float, dump: str | None = None) -> dict:
    """Registers, and over the innermost loops of the SASS: instructions, BAR / LDS / LDG counts
    (``dump``: also write the SASS there)."""
    tool = _nvidia_tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    if dump:
        Path(dump).write_text(sass)
    out = {}
    m = re.search(r"REG:(\d+)", res)
    if m:
        out["regs"] = int(m.group(1))
    m = re.search(r"LOCAL:(\d+)", res)
    if m and int(m.group(1)):
        out["spill"] = int(m.group(1))
    insns = [(int(a, 16), t.strip()) for a, t in INSN.findall(sass)]
    loops = []
    for addr, text in insns:
        m = re.search(r"\bBRA(?:\.\w+)*\s+(?:`?\(?)(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:  # (not the BRA to itself after EXIT)
            loops.append((int(m.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    body = [t for a, t in insns if any(lo <= a <= hi for lo, hi in inner)]

    def count(op):
        return sum(1 for t in body if re.sub(r"^@!?U?P\w+\s+", "", t).startswith(op))

    out.update(loops=len(inner), loop_insns=len(body), bar_in_loop=count("BAR"), lds=count("LDS"),
               sts=count("STS"), ldg=count("LDG"), shfl=count("SHFL"),
               bar_total=sum(1 for _, t in insns if re.sub(r"^@!?U?P\w+\s+", "", t).startswith("BAR")))  # fmt: skip
    if inner:
        out["per_code"] = len(body) / codes_per_iteration
    return out


def codes_per_iteration(cfg) -> float:
    """The codes one thread decodes in one iteration of each innermost loop, both matrices together."""
    bn, bk, warps = cfg
    return 2 * bn * bk / (32 * warps)


# ---- timing ---------------------------------------------------------------------------------


def time_graph(fns, reps: int = REPS, rounds: int = ROUNDS) -> float:
    """Median us per call of ``reps`` calls (cycling through ``fns``) captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / reps)
    del graph
    return statistics.median(times)


def copy_bandwidth(log) -> float:
    """Device-to-device copy GB/s (read + written bytes), the best of bench_kernels.copy_bandwidth's three ways."""
    n = 1 << 28  # 1 GiB each way
    nbytes = 2 * n * 4
    results = _copy_times(torch.randn(n, device="cuda"), torch.empty(n, device="cuda"))
    torch.cuda.empty_cache()
    for how, us in results.items():
        log(f"# copy {how:26s} {nbytes / (us * 1e-6) / 1e9:6.0f} GB/s")
    return max(nbytes / (us * 1e-6) / 1e9 for us in results.values())


def _copy_times(src: torch.Tensor, dst: torch.Tensor) -> dict[str, float]:
    results = {
        "graph memcpy": time_graph([lambda: dst.copy_(src)], reps=5, rounds=5),
        "graph SM copy (mul by 1)": time_graph([lambda: torch.mul(src, 1.0, out=dst)], reps=5, rounds=5),
    }
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    results["eager copy_"] = statistics.median(times)
    return results


def warm_up(seconds: float = 1.0) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_end = time.time() + seconds
    while time.time() < t_end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


# ---- main -----------------------------------------------------------------------------------


def fmt_row(r: dict) -> str:
    def f(key, spec, missing="-"):
        v = r.get(key)
        return format(v, spec) if isinstance(v, int | float) else missing

    bar = r.get("bar_in_loop")
    bar_s = "-" if bar is None else ("yes" if bar else "no")
    return (f"{r['name']:28s} {f('us', '8.2f'):>8s} {f('gbps', '6.0f'):>6s} {f('pct', '5.1f'):>5s} "
            f"{f('err', '8.1e'):>8s} {f('regs', 'd'):>4s} {f('per_code', '5.2f'):>5s} {bar_s:>4s} "
            f"{f('lds', 'd'):>3s} {f('ldg', 'd'):>3s}  {r.get('status', '')}")  # fmt: skip


HEADER = (f"{'variant':28s} {'us':>8s} {'GB/s':>6s} {'%copy':>5s} {'rel err':>8s} {'regs':>4s} {'i/cd':>5s} "
          f"{'BAR':>4s} {'LDS':>3s} {'LDG':>3s}  status")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=6, help="experts per launch (grid dim 1)")
    ap.add_argument("--n", type=int, default=2048, help="rows of w1 / w3 (the intermediate size)")
    ap.add_argument("--k", type=int, default=4096, help="columns (the hidden size)")
    ap.add_argument("--out", default=None, help="folder for the table (bench_mxfp4_gemv.txt)")
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter: correctness only")
    ap.add_argument(
        "--compile-only",
        type=int,
        default=None,
        metavar="ARCH",
        help="CPU: compile each kernel for sm_ARCH (ptxas), print its SASS statistics, run nothing",
    )
    ap.add_argument("--only", default=None, help="comma list of variant names")
    ap.add_argument("--sass", default=None, metavar="DIR", help="write each kernel's SASS into DIR")
    ap.add_argument("--budget-s", type=float, default=110.0, help="skip the variants left after this many s")
    args = ap.parse_args(argv)
    t0 = time.time()
    out_file = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out_file = Path(args.out, "bench_mxfp4_gemv.txt")
        out_file.write_text("")

    def log(s: str) -> None:  # the file grows line by line: a run cut short keeps its rows
        print(s, flush=True)
        if out_file is not None:
            with out_file.open("a") as f:
                f.write(s + "\n")

    variants = [v for v in VARIANTS if args.only is None or v[0] in args.only.split(",")]
    mode = "interpret" if args.interpret else "compile" if args.compile_only is not None else "gpu"
    if mode == "compile":
        from importlib.util import module_from_spec, spec_from_file_location

        spec = spec_from_file_location("compile_kernels", Path(__file__).resolve().parent / "compile_kernels.py")
        ck = module_from_spec(spec)
        spec.loader.exec_module(ck)
        ck.install(args.compile_only)
        device = "cpu"
    elif mode == "interpret":
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: use --interpret or --compile-only ARCH")
        device = "cuda"
    sets = SETS if mode == "gpu" else 1
    e, n, k = args.experts, args.n, args.k
    log(f"# bench_mxfp4_gemv: {mode}, experts {e}, w1/w3 [{n}, {k}] MXFP4, sets {sets}, triton {triton.__version__}, "
        f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if device == "cuda" else ""))  # fmt: skip
    if mode == "compile":  # nothing runs: one expert's bytes are enough for the signature
        x, w1, s1, w3, s3 = make_inputs(1, 16, 256, 1, device)
    else:
        x, w1, s1, w3, s3 = make_inputs(e, n, k, sets, device)
    g = torch.zeros(w1.shape[0], n, dtype=torch.float32, device=device)
    u = torch.zeros_like(g)
    nbytes = e * 2 * (n * k // 2 + n * k // 32)
    copy_bw = None
    if mode == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        warm_up()
        copy_bw = copy_bandwidth(log)
        log(f"# copy bandwidth {copy_bw:.0f} GB/s; {nbytes / 1e6:.1f} MB a launch; R={REPS} launches a graph, "
            f"median of {ROUNDS} replays")  # fmt: skip
    ref = None if mode == "compile" else reference(x, w1, s1, w3, s3)
    rows = []
    for name, kernel, flags, cfgs in variants:
        for cfg in cfgs:
            if mode == "interpret":
                cfg = (min(cfg[0], n), min(cfg[1], max(32, k // 2)), cfg[2])  # two K tiles at least
            bn, bk, warps = cfg
            r = {"name": f"{name} {bn}x{bk}w{warps}"}
            rows.append(r)
            if mode == "gpu" and time.time() - t0 > args.budget_s:
                r["status"] = "SKIPPED (time budget)"
                log(fmt_row(r))
                continue
            try:
                launch = launcher(kernel, flags, cfg, x, w1, s1, w3, s3, g, u, e, n, k)
                compiled = None
                for s in range(sets):
                    compiled = launch(s * e)
                if mode != "compile":
                    if device == "cuda":
                        torch.cuda.synchronize()
                    scale = max(ref[0].abs().max().item(), ref[1].abs().max().item())
                    r["err"] = max((g - ref[0]).abs().max().item(), (u - ref[1]).abs().max().item()) / scale
                    g.zero_()
                    u.zero_()
                if compiled is not None and hasattr(compiled, "asm"):
                    try:
                        dump = None
                        if args.sass:
                            os.makedirs(args.sass, exist_ok=True)
                            dump = os.path.join(args.sass, r["name"].replace(" ", "_") + ".sass")
                        r.update(sass_stats(compiled.asm["cubin"], codes_per_iteration(cfg), dump))
                        if getattr(compiled, "n_regs", None):
                            r["regs"] = compiled.n_regs
                    except Exception as exc:  # the table goes on without the SASS columns
                        r["status"] = f"(no SASS: {type(exc).__name__})"
                if mode == "gpu":
                    us = time_graph([lambda s=s, f=launch: f(s * e) for s in range(sets)])
                    r.update(us=us, gbps=nbytes / us / 1e3)
                    r["pct"] = 100 * r["gbps"] / copy_bw
                ok = r.get("err", 0.0) < 1e-4
                spill = f" (local {r['spill']} B)" if r.get("spill") else ""
                r["status"] = (r.get("status", "") + ("" if ok else " WRONG") + spill).strip() or "ok"
            except Exception as exc:
                r["status"] = f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
                traceback.print_exc()
            log(fmt_row(r))
    log("")
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    log(HEADER)
    for r in timed + [r for r in rows if "us" not in r]:
        log(fmt_row(r))
    log("# i/cd: SASS instructions in the innermost loops per code a thread decodes; BAR: a BAR in a loop; "
        "LDS / LDG: in the loops")  # fmt: skip
    if timed:
        best = timed[0]
        log(f"best: {best['name']} {best['us']:.2f} us, {best['gbps']:.0f} GB/s, {best['pct']:.1f}% of copy")
    log(f"# {time.time() - t0:.1f} s")
    bad = [r for r in rows if r.get("status", "").startswith("FAILED") or "WRONG" in r.get("status", "")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
