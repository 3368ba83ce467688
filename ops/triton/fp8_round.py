"""fp8_round_rows: W8A8's activation rounding (runtime.model.quant's fp8_round_activations) in one kernel.

Why: under ``activations="fp8"`` every FP8 / MXFP4 linear's input is rounded through e4m3 per
1 x 128 run before the GEMV. The torch rounding is about a dozen launches (a float copy, abs,
amax, the frexp of the scale, divide, clamp, the e4m3 cast and back, ...), and the chain rounds
eight inputs a step: the captured W8A8 step was 189 kernel nodes at B=1 against 29 for W8A16,
0.804 ms against 0.519 on an H100 (benchmarks/h200/chain_w8a8_c2f4da8_h100_log.txt). Here a
program reads RUNS runs of one row, takes each run's amax, and writes the rounded values.

Note "rounding by arithmetic": the values are rounded to e4m3's grid in fp32 arithmetic, not
by a cast to float8: Triton's CPU interpreter does not round that cast as the hardware does (it
moved 120 of 2,048 values of the CPU test's tile), and one formula on both keeps the CPU tests
about the code the GPU runs. A value v = x / scale (|v| <= 448 by the scale's choice) lies on
the grid of step 2^(max(floor(log2 |v|), -6) - 3) (3 mantissa bits; below 2^-6 the subnormal
step 2^-9); |v| / step is below 16, and (y + 2^23) - 2^23 rounds it to an integer, nearest,
ties to even, as the fp32 adds round. Every other product is by a power of two: exact. The
sign is put back by its bit, so -0 stays -0, as the cast keeps it. Bit-equal for finite inputs
only: a run holding an infinity or a NaN comes out non-finite here, where the torch rounding
turns an infinity into 448 times its scale and a NaN run's finite values into tiny ones (a
propose whose hiddens are not finite drafts nothing and is refused: ops/nonfinite.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from draftgraph.ops.quantised import w8a8_rounds
from draftgraph.ops.triton._common import pdl_args, pdl_wait, rows_view
from draftgraph.runtime.errors import InputError, describe
from draftgraph.runtime.model.quant import ACT_AMAX_FLOOR, ACT_BLOCK, E4M3_MAX

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RUNS = 4  # runs of 128 a program: 512 columns, a V4-Flash hidden row (4096) is 8 programs
TWO_23: tl.constexpr = tl.constexpr(8388608.0)
AMAX_FLOOR: tl.constexpr = tl.constexpr(ACT_AMAX_FLOOR)
FP8_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)


@triton.jit
def pow2(biased_exponent):
    """2^(e - 127) from the biased exponent e (1..254): the float with those exponent bits."""
    return (biased_exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def run_exponents(xv):
    """x [R, 128] fp32 -> the biased exponent e of each row's scale 2^(e - 127) =
    2^ceil(log2(max(amax, 1e-4) / 448)), the reference's, made from the bits (no log2 / exp2
    rounding). W8A8's one scale rule: this rounding's and fp8_linear's act_fp8_block."""
    amax = tl.maximum(tl.max(tl.abs(xv), 1), AMAX_FLOOR)
    r = (amax / FP8_MAX).to(tl.int32, bitcast=True)
    return ((r >> 23) & 0xFF) + ((r & 0x7FFFFF) != 0).to(tl.int32)  # biased ceil(log2(r)) for normal r


@triton.jit
def round_runs(xv):
    """x [R, 128] fp32 -> x rounded through e4m3 per row of the tile, in fp32 (the note's arithmetic)."""
    e = run_exponents(xv)
    scale = pow2(e)
    v = xv * pow2(254 - e)[:, None]  # x / scale, exactly
    bits = v.to(tl.int32, bitcast=True)
    ev = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # floor(log2 |v|), or the subnormals' -6
    y = tl.abs(v) * pow2(127 + 3 - ev)  # |v| / step: below 16
    y = (y + TWO_23) - TWO_23  # to an integer, nearest, ties to even
    mag = y * pow2(127 - 3 + ev) * scale[:, None]
    return (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def round_row(y, BLOCK: tl.constexpr):
    """A row [BLOCK] fp32 (BLOCK a multiple of 128, zeros past the row's end) rounded through e4m3 per
    run of 128: a norm's output rounded where the norm writes it (one launch fewer than a rounding
    launch after it)."""
    return tl.reshape(round_runs(tl.reshape(y, (BLOCK // 128, 128))), (BLOCK,))


@triton.jit
def _round_rows_kernel(x, out, n, stride_x, stride_o, RUNS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * (RUNS * 128) + tl.arange(0, RUNS)[:, None] * 128 + tl.arange(0, 128)[None, :]
    inside = cols < n
    xv = tl.load(x + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, round_runs(xv).to(out.dtype.element_ty), mask=inside)


def fp8_round_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_round_activations(x)`` (runs of 128 along the last dim, a ragged last run padded with
    zeros) into ``out`` (a new contiguous tensor when None; ``out=x`` rounds in place), one launch.
    ``x`` and ``out`` are rows: viewable as [R, last] without a copy (``_common.rows_view``).

    >>> fp8_round_rows(hidden)  # [B, 4096] bf16 -> the same values W8A8's GEMV multiplies
    """
    x2 = _rows(x)
    if x2 is None or x.dtype not in _DTYPES:
        raise InputError(describe("fp8_round_rows x", "bf16 / fp16 / fp32 rows ([R, last] with no copy), >= 1 dim",
                                  f"{x.dtype} {tuple(x.shape)} strides {x.stride()}",
                                  "pass x.contiguous() (the chain's activations are)"))  # fmt: skip
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = _rows(out)
    if out.shape != x.shape or out.dtype != x.dtype or o2 is None or out.device != x.device:
        raise InputError(describe("fp8_round_rows out", f"{x.dtype} {tuple(x.shape)} on {x.device}, unit-stride rows",
                                  f"{out.dtype} {tuple(out.shape)} {out.device} strides {out.stride()}"))  # fmt: skip
    if x.numel() == 0:
        return out
    grid = (x2.shape[0], triton.cdiv(x2.shape[1], RUNS * ACT_BLOCK))
    _round_rows_kernel[grid](x2, o2, x2.shape[1], x2.stride(0), o2.stride(0), RUNS=RUNS, **pdl_args(x.device))
    return out


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``_common.rows_view`` of t; an empty t (no element to read or write) as [0, last] whatever its strides."""
    return t.reshape(0, t.shape[-1]) if t.dim() and t.numel() == 0 else rows_view(t)


def w8a8_input(x: torch.Tensor, w, attrs) -> torch.Tensor:
    """ops/quantised.py's act_in by the kernel: ``x`` rounded through FP8 where :func:`w8a8_rounds`, else ``x``."""
    return fp8_round_rows(x) if w8a8_rounds(w, attrs) else x
