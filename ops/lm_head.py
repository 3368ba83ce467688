"""lm_head: the final vanilla RMS norm, then the head GEMV over the drafting vocab, fp32 logits.

``vocab_rows`` (mtp_vocab_size when > 0, else the full vocab) limits the head
rows read: drafting only ever picks among them, so the rest are never touched.

The head may be a block-scaled :class:`~draftgraph.runtime.model.quant.QuantWeight`
(``ProposerOptions.head_dtype="fp8"``: the head rows quantised at load, for drafting only).
The torch op then dequantises a static chunk of whole 128-row blocks at a time (design note
"dequantise what is read", ops/quantised.py): never a full bf16 copy of the head. The
dequantisation is exact, so the logits are those of the bf16 head ``dequant(q)``.
"""

from __future__ import annotations

import torch
from draftgraph.ops.basic import rms_norm
from draftgraph.ops.quantised import expect_weight
from draftgraph.ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec, require_attrs
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, expect_rank, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.quant import FP8_BLOCK, QuantWeight, dequantize_rows

CPU_ROWS_PER_CHUNK = 8192  # bounds the fp32 copy of head rows made on CPU
QUANT_ROWS_PER_CHUNK = 32 * FP8_BLOCK  # a quantised head's rows dequantised at a time (whole FP8 blocks)


def _vocab_rows(attrs, vocab: int) -> int:
    rows = int(attrs.get("vocab_rows", 0) or 0)
    return vocab if rows == 0 else rows


def _lm_head_infer(specs, attrs):
    expect_count(specs, 3, "lm_head")
    require_attrs(attrs, ("eps",), "lm_head")
    h, norm_w, head = specs
    expect_rank(h, 2, "lm_head h [B, D]")
    expect_rank(head, 2, "lm_head head [V, D]")
    b, dim = batch_of(h, "lm_head h"), h.shape[1]
    expect_spec(h, (b, dim), ACTIVATIONS, "lm_head h")
    expect_spec(norm_w, (dim,), h.dtype, "lm_head norm_w")
    vocab = head.logical_shape[0]
    expect_weight(head, (vocab, dim), h.dtype, "lm_head head")
    rows = _vocab_rows(attrs, vocab)
    expect(0 < rows <= vocab, "lm_head vocab_rows", f"1..{vocab} (0 = all)", rows)
    return [TensorSpec((b, rows), torch.float32)]


def _lm_head_impl(inputs, outputs, attrs, workspace):
    h, norm_w, head = inputs
    (logits,) = outputs  # [B, Vd] fp32
    normed = rms_norm(h, norm_w, float(attrs["eps"]))  # cast back to bf16, as the spec's norms
    if isinstance(head, QuantWeight):
        _quantised_head(normed, head, logits)
        return
    rows = head[: logits.shape[1]]  # [Vd, D]
    if h.dtype == torch.float32:
        torch.mm(normed, rows.t(), out=logits)
    elif h.is_cuda:
        # Half operands, fp32 accumulate and fp32 output: no fp32 copy of the head.
        torch.mm(normed, rows.t(), out_dtype=torch.float32, out=logits)
    else:
        # CPU lacks mm's out_dtype: widen the head a static chunk of rows at a time.
        wide = normed.float()
        for start in range(0, rows.shape[0], CPU_ROWS_PER_CHUNK):
            chunk = rows[start : start + CPU_ROWS_PER_CHUNK]
            logits[:, start : start + chunk.shape[0]].copy_(wide @ chunk.float().t())


def _quantised_head(normed: torch.Tensor, head: QuantWeight, logits: torch.Tensor) -> None:
    """logits [B, Vd] = normed @ dequant(head[:Vd])^T, QUANT_ROWS_PER_CHUNK dequantised rows at a time.

    CPU (and fp32 activations): the rows are dequantised straight to fp32 (exact), as the bf16
    path widens its chunks. CUDA: to the activations' dtype (exact too) and one mm with fp32 out.
    """
    num_rows = logits.shape[1]
    wide = normed.float() if not normed.is_cuda or normed.dtype == torch.float32 else None
    for start in range(0, num_rows, QUANT_ROWS_PER_CHUNK):
        stop = min(num_rows, start + QUANT_ROWS_PER_CHUNK)
        if wide is not None:
            logits[:, start:stop].copy_(wide @ dequantize_rows(head, start, stop, torch.float32).t())
        else:
            chunk = dequantize_rows(head, start, stop, normed.dtype)  # [R, D]
            logits[:, start:stop].copy_(torch.mm(normed, chunk.t(), out_dtype=torch.float32))


LM_HEAD = register(
    OpDef(
        name="lm_head",
        family="head",
        infer=_lm_head_infer,
        impl=_lm_head_impl,
        doc="logits = head[:vocab_rows] @ rms_norm(h, norm_w): fp32 [B, vocab_rows].",
    )
)
