"""Per-lane loads and bf16 pairs: the pieces of the word kernels that keep every load in its lane.

A tensor broadcast along a tile's rows (the activation of a GEMV at batch 1, the batch columns
of an mma's B fragment) is, in Triton's layouts, held by the threads of every row; a
``tl.load`` of it is issued once and moved to those threads through shared memory, with a
barrier in the loop. These loads are inline PTX on each thread's own pointers instead: every
thread loads what it multiplies (from L1 / L2 after the first), and no value crosses lanes.
The interpreter runs no PTX: there they are plain loads.

The activations are read as int32 bf16 pairs (column 2j in the low half): ``bf16_lo`` / ``bf16_hi``
give the two values as fp32 by shifts, no conversion instruction.
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
def ld_v2(ptr, INTERP: tl.constexpr):
    """Two int32 at each pointer (8-byte aligned), loaded by every thread holding it (as ``ld_v4``)."""
    if INTERP:
        return tl.load(ptr), tl.load(ptr + 1)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [ptr],
                                         dtype=(tl.int32,) * 2, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def bf16_lo(pair):
    """The low bf16 of int32 pairs, as fp32."""
    return (pair << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf16_hi(pair):
    """The high bf16 of int32 pairs, as fp32."""
    return (pair & -65536).to(tl.float32, bitcast=True)
