"""The torch reference ops on block-scaled weights (FP8 128x128, MXFP4 1x32), and W8A8.

A weight kept as the checkpoint stores it is a :class:`~draftgraph.runtime.model.quant.QuantWeight`
bound under the graph's weight name; its spec carries the format (graphs/v4_block.py, design
note "numerics"). These ops are the reference and the CPU path; the fused kernels
(ops/triton) take over on CUDA where they exist.

Design note "dequantise what is read": no full bf16 copy of a large weight is ever made. A
weight whose bf16 form fits ``DEQUANT_CHUNK_BYTES`` is dequantised whole into a temporary and
run through the very GEMM the bf16 path runs, so on the same checkpoint the two paths agree
bit for bit (the dequantisation is exact: a power of two times an e4m3/e2m1 value); a
larger one is walked a block of 128 output rows at a time, each block's GEMM accumulating in
fp32 as the bf16 one does. The MoE dequantises only the chosen experts of each row.

W8A8 (``activations="fp8"``): the input of each block-scaled linear is rounded through FP8 e4m3
per 1x128 run with a power-of-two scale (quant.fp8_round_activations) before the GEMM. The
rounded values are exact in bf16, so a bf16 GEMM on them computes what an FP8 x FP8 GEMM with
fp32 accumulation computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from draftgraph.ops.v4_shapes import expect_spec
from draftgraph.runtime.ir.op_registry import expect
from draftgraph.runtime.ir.tensor_spec import Dim, TensorSpec
from draftgraph.runtime.model.quant import FP8_BLOCK, QuantWeight, dequantize_rows, fp8_round_activations

DEQUANT_CHUNK_BYTES = 32 << 20  # the largest dequantised temporary a linear makes (a block of rows)
EXPERT_PAIRS_BYTES = 128 << 20  # the MoE's dequantised experts at a time (ops/moe.py routed_quantised)

Weight = torch.Tensor | QuantWeight


def is_quantised(w) -> bool:
    return isinstance(w, QuantWeight)


def expect_weight(spec: TensorSpec, shape: Sequence[Dim], dtype: torch.dtype, what: str) -> None:
    """``spec`` is ``dtype[shape]``, or a block-scaled weight of logical shape ``shape``."""
    if not spec.is_quantised:
        expect_spec(spec, shape, dtype, what)
        return
    expect(tuple(spec.logical_shape) == tuple(shape), what, f"a weight of logical shape {list(shape)}", spec.short())


def w8a8_rounds(w: Weight, attrs) -> bool:
    """Whether a GEMM on ``w`` takes its input rounded through FP8: ``w`` block-scaled and the attrs
    asking for W8A8 (``activations="fp8"``). The torch ops' act_in and the fused impls ask this."""
    return is_quantised(w) and attrs.get("activations") == "fp8"


def act_in(x: torch.Tensor, w: Weight, attrs) -> torch.Tensor:
    """The GEMM's input: ``x``, rounded through FP8 (W8A8) where :func:`w8a8_rounds`."""
    return fp8_round_activations(x) if w8a8_rounds(w, attrs) else x


def rows_per_chunk(w: QuantWeight, dtype: torch.dtype) -> int:
    """Output rows dequantised at a time: all of them when they fit DEQUANT_CHUNK_BYTES, else whole 128-row blocks."""
    rows, cols = w.logical_shape[-2], w.logical_shape[-1]
    per_row = cols * dtype.itemsize * max(1, w.data[..., 0, 0].numel())
    if rows * per_row <= DEQUANT_CHUNK_BYTES:
        return rows
    return max(FP8_BLOCK, DEQUANT_CHUNK_BYTES // per_row // FP8_BLOCK * FP8_BLOCK)


def linear_t(x: torch.Tensor, w: Weight, attrs=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, I] @ w^T -> [N, O] in x's dtype (into ``out`` if given): the bf16 GEMM, or block by block.

    A plain tensor runs exactly ``torch.matmul(x, w.t(), out=out)``.
    """
    if not is_quantised(w):
        return torch.matmul(x, w.t(), out=out)
    x = act_in(x, w, attrs or {})
    rows = w.logical_shape[-2]
    chunk = rows_per_chunk(w, x.dtype)
    if chunk >= rows:
        return torch.matmul(x, w.dequantize(x.dtype).t(), out=out)
    if out is None:
        out = x.new_empty(x.shape[0], rows)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        out[:, start:stop].copy_(x @ dequantize_rows(w, start, stop, x.dtype).t())
    return out


def grouped_linear_t(o: torch.Tensor, w: Weight, groups: int, out: torch.Tensor, attrs=None) -> None:
    """z_g = o_g @ w_g^T for each of ``groups`` row groups of w: o [G, B, K], w [G*R, K], out [G, B, R].

    The attention's wo_a. A plain tensor runs the bf16 path's one bmm.
    """
    if not is_quantised(w):
        torch.bmm(o, w.view(groups, -1, o.shape[-1]).transpose(1, 2), out=out)
        return
    o = act_in(o, w, attrs or {})
    rows = w.logical_shape[-2]
    if rows_per_chunk(w, o.dtype) >= rows:
        torch.bmm(o, w.dequantize(o.dtype).view(groups, -1, o.shape[-1]).transpose(1, 2), out=out)
        return
    per_group = rows // groups
    for g in range(groups):  # one group's rows at a time (1024 x 4096 at V4-Flash: 8 MB in bf16)
        out[g].copy_(o[g] @ dequantize_rows(w, g * per_group, (g + 1) * per_group, o.dtype).t())


def chosen_experts(w: QuantWeight, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts ``idx`` [B, K] of a stacked block-scaled weight [E, O, I], dequantised: [B, K, O, I].

    Only the chosen experts' bytes are read (an index on the stored bytes and scales), as the
    bf16 path's gather reads only theirs.
    """
    data = w.data.view(torch.uint8)[idx].view(w.data.dtype)  # float4 has no index kernel: index its bytes
    chosen = QuantWeight(data, w.scale[idx], w.fmt)
    return chosen.dequantize(dtype)
