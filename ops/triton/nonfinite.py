"""drop_nonfinite and mark_dropped (ops/nonfinite.py), one kernel each.

Why: the torch ops take five launches a step (the finiteness GEMV, a compare and a select for
the drop; a compare and a select for the mark), which made the captured K=1 step 37 kernel
nodes where issue 28 asks for at most 35 (33 with these, bbbd33f on an H200). The positions are
read by stride: at B > 1 the chain passes a column of its metadata block, and until the seventh
session that sent B > 1 to the torch op (four launches: 37 nodes at B=8 and 32 by the e901c32
profile on an H200, 33 at B=1). The drop reads
the batch's hiddens once (B x C x D bf16: 32 KB a row at V4-Flash, 1 MB at B = 32), the mark a
few dozen ints.

Whether the batch holds a NaN or an infinity is one bit for all rows (ops/nonfinite.py: the
whole call is refused). Up to DROP_GRID_MIN_ROWS rows drop_nonfinite is one program, which loops
over the hiddens in wide tiles (16 Ki elements, 16 warps, four 16-byte loads a thread in flight).
Measured in the chain (bbbd33f, bf16 weights, against the torch ops at 078dabc): B=1 0.500 ->
0.493 ms, B=8 0.698 -> 0.694, B=32 0.920 -> 0.917. An element is bad where ``|x| <= FLT_MAX`` is
false: NaN compares false, inf exceeds it; no arithmetic a compiler could fold away.

Note "tiles": one program is bound by its one SM's loads: at B = 32 (32 tiles, 1 MB) 23.4 us on
an H200 in the chain and 39 us in an ncu profile of the chain on an H100 (cold L2;
benchmarks/h200/ncu_chain_b1_b32_h100.txt), the first step of every propose; two tiles' loads
issued together each loop step took the same (23.5, 4d5dc37, removed). From DROP_GRID_MIN_ROWS
rows it is two launches: a program a tile writes its verdict, then one program merges them and
writes the positions (a last-program merge in one launch would need a count zeroed before it,
and this op has no launch before it to zero one). One kernel node more. The chain, one process
on an H100 (benchmarks/h200/sinkhorn_drop_one_process_h100_log.txt, best of three): B=8 0.6749
-> 0.6695 ms, B=32 0.9220 -> 0.9005. The threshold of 4 rows is where the two launches' fixed
cost (~2 us each) meets the one program's serial tiles (~1 us each): estimated, not measured.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from draftgraph.ops.nonfinite import DROPPED, NONFINITE, _drop_impl, _mark_impl
from draftgraph.ops.triton._common import carve, next_pow2, pdl_args, pdl_wait, scratch_bytes

DROP_BLOCK = 16384
DROP_WARPS = 16
DROP_GRID_MIN_ROWS = 4  # from this many rows: a program a tile, then a merge launch (note "tiles")
DROPPED_POS: tl.constexpr = tl.constexpr(DROPPED)
NONFINITE_ID: tl.constexpr = tl.constexpr(NONFINITE)
FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _write_positions(positions, out, dropped, B, stride_p, stride_o, BLOCK_B: tl.constexpr):
    """out[r] = positions[r] for every row, or DROPPED for all of them where ``dropped``."""
    rows = tl.arange(0, BLOCK_B)
    inside = rows < B
    p = tl.load(positions + rows * stride_p, mask=inside, other=0)
    tl.store(out + rows * stride_o, tl.where(dropped, DROPPED_POS, p), mask=inside)


@triton.jit
def _drop_nonfinite_kernel(positions, hidden, out, B, N, stride_p, stride_o, BLOCK: tl.constexpr,
                           BLOCK_B: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_wait(PDL)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(hidden + offs, mask=offs < N, other=0.0).to(tl.float32)
        bad = bad | (~(tl.abs(x) <= FLT_MAX)).to(tl.int32)
    dropped = tl.max(bad, axis=0) != 0
    _write_positions(positions, out, dropped, B, stride_p, stride_o, BLOCK_B)


@triton.jit
def _nonfinite_tiles_kernel(hidden, verdicts, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program t: whether tile t of the hidden (BLOCK elements) holds a NaN or an infinity."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs = t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(hidden + offs, mask=offs < N, other=0.0).to(tl.float32)
    bad = (~(tl.abs(x) <= FLT_MAX)).to(tl.int32)
    tl.store(verdicts + t, tl.max(bad, axis=0))


@triton.jit
def _drop_merge_kernel(positions, verdicts, out, B, T, stride_p, stride_o, BLOCK_T: tl.constexpr,
                       BLOCK_B: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The tiles' verdicts merged: every row's position, or DROPPED for all if any tile was bad."""
    pdl_wait(PDL)
    tiles = tl.arange(0, BLOCK_T)
    dropped = tl.max(tl.load(verdicts + tiles, mask=tiles < T, other=0), axis=0) != 0
    _write_positions(positions, out, dropped, B, stride_p, stride_o, BLOCK_B)


def _grid_tiles(b: int, n: int) -> int:
    """The tiles of a grid launch for b rows of n values in all, or 0 where one program runs (note "tiles")."""
    return triton.cdiv(n, DROP_BLOCK) if b >= DROP_GRID_MIN_ROWS and n > DROP_BLOCK else 0


def drop_nonfinite_workspace(specs, attrs, batch: int) -> int:
    """Scratch bytes of drop_nonfinite at a concrete batch: a verdict a tile when the tiles are a grid."""
    tiles = _grid_tiles(batch, batch * math.prod(specs[1].shape[1:]))
    return scratch_bytes([((tiles,), torch.int32)]) if tiles else 0


def drop_nonfinite_impl(inputs, outputs, attrs, workspace):
    positions, hidden = inputs
    (out,) = outputs
    # Positions and out by stride: in the chain at B > 1 the positions are a column of the staged
    # metadata block (one row a sequence), and the torch op's four launches took their place.
    if not hidden.is_contiguous():
        _drop_impl(inputs, outputs, attrs, workspace)
        return
    b = positions.shape[0]
    n = hidden.numel()
    tiles = _grid_tiles(b, n)
    if tiles:  # a program a tile, then one merge (note "tiles")
        (verdicts,) = carve(workspace, hidden.device, [((tiles,), torch.int32)])
        pdl = pdl_args(hidden.device)
        _nonfinite_tiles_kernel[(tiles,)](hidden, verdicts, n, BLOCK=DROP_BLOCK, num_warps=DROP_WARPS, **pdl)
        _drop_merge_kernel[(1,)](positions, verdicts, out, b, tiles, positions.stride(0), out.stride(0),
                                 BLOCK_T=next_pow2(tiles), BLOCK_B=max(16, next_pow2(b)), num_warps=1,
                                 **pdl)  # fmt: skip
        return
    block = min(DROP_BLOCK, max(256, next_pow2(n)))
    _drop_nonfinite_kernel[(1,)](positions, hidden, out, b, n, positions.stride(0), out.stride(0), BLOCK=block,
                                 BLOCK_B=max(16, next_pow2(b)), num_warps=DROP_WARPS,
                                 **pdl_args(hidden.device))  # fmt: skip


@triton.jit
def _mark_dropped_kernel(drafts, positions, out, B, K, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    pdl_wait(PDL)
    rows = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_K)
    inside = (rows < B)[:, None] & (cols < K)[None, :]
    dropped = tl.load(positions + rows, mask=rows < B, other=0) == DROPPED_POS
    d = tl.load(drafts + rows[:, None] * K + cols[None, :], mask=inside, other=0)
    tl.store(out + rows[:, None] * K + cols[None, :], tl.where(dropped[:, None], NONFINITE_ID, d), mask=inside)


def mark_dropped_impl(inputs, outputs, attrs, workspace):
    drafts, positions = inputs
    (out,) = outputs
    if not (drafts.is_contiguous() and positions.is_contiguous() and out.is_contiguous()):
        _mark_impl(inputs, outputs, attrs, workspace)
        return
    b, k = drafts.shape
    _mark_dropped_kernel[(1,)](drafts, positions, out, b, k, BLOCK_B=max(16, next_pow2(b)),
                               BLOCK_K=max(2, next_pow2(k)), num_warps=1, **pdl_args(drafts.device))  # fmt: skip


__all__ = ["drop_nonfinite_impl", "mark_dropped_impl"]
