"""combine: the MTP combiner, h_proj(hnorm(h)) + e_proj(enorm(e)) (spec section 5).

One op, not five nodes (two norms, two projections, an add), because its two halves are
independent: the embedding half (enorm, e_proj) runs on a side lane (draftgraph.ops.overlap) beside the
hidden half's projection (hnorm runs first), and the sum joins them. At batch 1 each half is
a norm and a 32 MB GEMV, about 20 us in a row on an H200; side by side the two GEMVs share
the memory bandwidth instead of waiting for each other.

Streams mode: h is the target's streams [B, C, D]; e_proj(enorm(e)) is added to every stream
(a broadcast inside the add, not an hc_expand copy). Collapsed mode: h is [B, D] and so is
the result (hc_expand follows). The arithmetic is the five nodes' own: the same norms, the
same GEMMs, one rounding to the activation dtype each, and the sum rounded once.
"""

from __future__ import annotations

import torch
from draftgraph.ops.basic import rms_norm
from draftgraph.ops.embed import EMBED
from draftgraph.ops.overlap import join_side_stream, side_stream
from draftgraph.ops.quantised import expect_weight, linear_t
from draftgraph.ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec, require_attrs
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, register


def _combiner_infer(specs, attrs):
    expect_count(specs, 6, "combiner")
    require_attrs(attrs, ("eps",), "combiner")
    e, h, e_norm, h_norm, e_proj, h_proj = specs
    expect(len(h.shape) in (2, 3), "combiner h rank", "[B, D] or streams [B, C, D]", h.short())
    b, d = batch_of(e, "combiner e"), h.shape[-1]
    if len(e.shape) == 3:  # the declared streams mode: e already expanded to h's streams
        expect_spec(e, h.shape, ACTIVATIONS, "combiner e")
    else:
        expect_spec(e, (b, d), ACTIVATIONS, "combiner e")
    expect_spec(h, (b, *h.shape[1:]), e.dtype, "combiner h")
    for w, what in ((e_norm, "enorm"), (h_norm, "hnorm")):
        expect_spec(w, (d,), e.dtype, f"combiner {what}")
    for w, what in ((e_proj, "e_proj"), (h_proj, "h_proj")):
        expect_weight(w, (d, d), e.dtype, f"combiner {what}")  # bf16, or FP8 as stored (ops/quantised.py)
    return [h]


def project(x: torch.Tensor, norm_w: torch.Tensor, proj_w, eps: float, attrs=None) -> torch.Tensor:
    """proj(norm(x)) over the last dim: [..., D] in x's dtype."""
    return projected(rms_norm(x, norm_w, eps), proj_w, attrs)


def projected(normed: torch.Tensor, proj_w, attrs=None) -> torch.Tensor:
    """normed @ proj_w^T over the last dim, as one GEMM over the flattened rows: [..., D].

    ``proj_w`` a bf16 tensor or a block-scaled QuantWeight (ops/quantised.py).
    """
    flat = linear_t(normed.reshape(-1, normed.shape[-1]), proj_w, attrs)
    return flat.view(*normed.shape[:-1], flat.shape[-1])


def _combiner_impl(inputs, outputs, attrs, workspace):
    e, h, e_norm, h_norm, e_proj, h_proj = inputs
    (out,) = outputs
    eps = float(attrs["eps"])
    # hnorm before the fork: captured, a fork right after the graph's first two kernels made the
    # second one start ~9 us late on an H200 (benchmarks/h200/ab_combine_fork_5e4d57c.txt in git at 873b0e1); with
    # hnorm first it starts at once and the combiner ends ~5 us sooner (ab_combine_fork_9dd546b.txt).
    h_normed = rms_norm(h, h_norm, eps)
    with side_stream():  # its temporaries are the lane's; the main stream reads e_part after the join
        e_part = project(e, e_norm, e_proj, eps, attrs)  # [B, D], or [B, C, D] as declared in streams mode
    h_part = projected(h_normed, h_proj, attrs)  # [B, (C,) D]
    join_side_stream()
    torch.add(h_part, e_part.unsqueeze(1) if e.dim() < h.dim() else e_part, out=out)


COMBINER = register(
    OpDef(
        name="combiner",
        family="linear",
        infer=_combiner_infer,
        impl=_combiner_impl,
        doc="h_proj(hnorm(h)) + e_proj(enorm(e)), e broadcast over h's streams; e's half beside h's.",
    )
)


# ---- embed_combiner (the fold_embed_into_combiner pass's op) ----------------------------------


def _embed_combiner_infer(specs, attrs):
    expect_count(specs, 7, "embed_combiner")
    token, table, *rest = specs
    (e,) = EMBED.infer([token, table], {})
    return _combiner_infer([e, *rest], attrs)


def _embed_combiner_impl(inputs, outputs, attrs, workspace):
    token, table, *rest = inputs
    # The reference runs the two folded ops as they were: the gather into a row block, then the
    # combiner on it (the fused impl reads the table rows where its norms read e).
    e = torch.index_select(table, 0, token)
    _combiner_impl([e, *rest], outputs, attrs, workspace)


EMBED_COMBINER = register(
    OpDef(
        name="embed_combiner",
        family="linear",
        infer=_embed_combiner_infer,
        impl=_embed_combiner_impl,
        doc="(token, table, h, enorm, hnorm, e_proj, h_proj) -> combiner(embed(token, table), h, ...): the embed "
            "whose row only the combiner reads, folded (runtime/passes/fold_embed_into_combiner.py).",
    )
)
