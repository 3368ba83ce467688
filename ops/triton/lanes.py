"""Per-lane loads and bf16 pairs: the pieces of the word kernels that keep every load in its lane.

A tensor broadcast along a tile's rows (the activation of a GEMV at batch 1, the batch columns
of an mma's B fragment) is, in Triton's layouts, held by the threads of every row; a
``tl.load`` of it is issued once and moved to those threads through shared memory, with a
barrier in the loop. These loads are inline PTX on each thread's own pointers instead: every
thread loads what it multiplies (from L1 / L2 after the first), and no value crosses lanes.
The interpreter runs no PTX: there they are plain loads. The price: Triton's software pipeline
(``num_stages``, ``cp.async`` into shared memory) does not take inline-PTX loads, so a loop of them
pays each tile's latency in turn. That pays where the decode binds (the MXFP4 words) and did not
for FP8, whose decode is one conversion (words and an mma GEMV measured slower than the pipelined
tiles and removed, fc9e251: benchmarks/h200/KERNEL_RUNS.md, "Fifth device runs").

The activations are read as int32 bf16 pairs (column 2j in the low half): ``bf16_lo`` / ``bf16_hi``
give the two values as fp32 by shifts, no conversion instruction. ``lane_store`` stores by the lane
that holds the value, for the same reason. ``quad_sum`` and ``lane_pick`` are the interpreter's
model of an ``mma.sync.m16n8k16``'s fragments (the mma kernels' twins): lane (g, t) of a warp.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ld_v4(ptr, INTERP: tl.constexpr):
    """Four int32 at each pointer (16-byte aligned), loaded by every thread holding the pointer: a
    tensor broadcast along the tile's rows needs no layout conversion (no shared memory, no barrier)."""
    if INTERP:
        return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def ld_u8(ptr, INTERP: tl.constexpr):
    """The byte at each pointer as int32, loaded by the thread holding the pointer (as ``ld_v4``)."""
    if INTERP:
        return tl.load(ptr).to(tl.int32)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True,
                                         pack=1)  # fmt: skip


@triton.jit
def ld_b32(ptr, INTERP: tl.constexpr):
    """The 32-bit word at each pointer (int32 or fp32 pointers; returned as their type), loaded by
    the thread holding the pointer (as ``ld_v4``; a plain load: a table the kernel before wrote)."""
    if INTERP:
        return tl.load(ptr)
    else:
        bits = tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ptr.to(tl.pointer_type(tl.int32),
                                         bitcast=True)], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        return bits.to(ptr.dtype.element_ty, bitcast=True)


@triton.jit
def ld_b32_shared(ptr, INTERP: tl.constexpr):
    """The fp32 word at each pointer, written by another program of the same launch and read after the
    acquire that saw it done (a split's partials): at L2 (``.cg``, never a stale line of this SM's
    L1), and not pure, so the compiler cannot move it before that acquire."""
    if INTERP:
        return tl.load(ptr)
    else:
        bits = tl.inline_asm_elementwise("ld.global.cg.b32 $0, [$1];", "=r,l", [ptr.to(tl.pointer_type(tl.int32),
                                         bitcast=True)], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_lo(pair):
    """The low bf16 of int32 pairs, as fp32."""
    return (pair << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf16_hi(pair):
    """The high bf16 of int32 pairs, as fp32."""
    return (pair & -65536).to(tl.float32, bitcast=True)


# Stores by the lane that holds the value (no layout anchor), where $3 != 0.
ST_F32_PTX = tl.constexpr("{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.b32 [$1], $2;\nmov.b32 $0, 0;\n}")
ST_B16_PTX = tl.constexpr(
    "{\n.reg .pred p;\n.reg .b16 h;\nsetp.ne.b32 p, $3, 0;\ncvt.u16.u32 h, $2;\n@p st.global.b16 [$1], h;\n"
    "mov.b32 $0, 0;\n}"
)


@triton.jit
def quad_sum(a, x, W: tl.constexpr):
    """[W, 8 (weight row g), 8 (column n)]: sum over the 4 lanes t of a (lane (w, g, t)'s value) times
    x (lane (w, n, t)'s value): one code's share of a warp's 8 x 8 block of C."""
    a3 = tl.reshape(a, [W, 8, 4])
    x3 = tl.reshape(x, [W, 8, 4])
    return tl.sum(a3[:, :, None, :] * x3[:, None, :, :], 3)


@triton.jit
def lane_pick(c, t, odd, W: tl.constexpr):
    """Lane (w, g, t)'s C value c[w, g, 2t + odd] of a [W, 8, 8] block, as a [32 W] tensor."""
    n = tl.arange(0, 8)[None, None, :, None]
    hit = n == (2 * tl.reshape(t, [W, 8, 4]) + odd)[:, :, None, :]
    return tl.reshape(tl.sum(tl.where(hit, c[:, :, :, None], 0.0), 2), [32 * W])


@triton.jit
def lane_store(ptr, v, live, INTERP: tl.constexpr):
    """ptr[i] = v[i] (fp32, or rounded to ptr's bf16) where live, by the lane that holds it."""
    if INTERP:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=live != 0)
    elif ptr.dtype.element_ty == tl.float32:
        tl.inline_asm_elementwise(ST_F32_PTX, "=r,l,r,r", [ptr.to(tl.int64), v.to(tl.int32, bitcast=True),
                                  live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    else:
        bits = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        tl.inline_asm_elementwise(ST_B16_PTX, "=r,l,r,r", [ptr.to(tl.int64), bits, live.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
