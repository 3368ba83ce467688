"""mHC (manifold-constrained hyper-connections): hc_expand, hc_pre, hc_post, hc_head.

Spec section 2. The residual state X [B, C, D] holds C streams; hc_pre mixes
them into one layer input y plus the weights hc_post uses to write the layer's
output back. All mixing math is fp32; bf16 only at the boundaries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from draftgraph.ops import constants
from draftgraph.ops.basic import rms_norm_into
from draftgraph.ops.overlap import side_stream
from draftgraph.ops.v4_shapes import ACTIVATIONS, batch_of, expect_spec, require_attrs
from draftgraph.runtime.ir.op_registry import OpDef, expect, expect_count, expect_rank, register
from draftgraph.runtime.ir.tensor_spec import TensorSpec

F32 = torch.float32


def _streams(spec: TensorSpec, what: str) -> tuple:
    expect_rank(spec, 3, f"{what} [B, C, D]")
    expect_spec(spec, spec.shape, ACTIVATIONS, what)
    return spec.shape  # (B, C, D)


def _mix_logits(Xf: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """m = (x @ fn^T) * rho, rho = 1 / rms over all C*D of each row: [B, M] fp32 from Xf [B, C, D] fp32.

    rho scales each row, so it is applied before the GEMM: one fused RMS norm (no weight)
    then one matmul, equal to the spec's order within fp32 rounding.
    """
    x = Xf.flatten(1)  # [B, C*D]
    return F.rms_norm(x, x.shape[-1:], eps=eps) @ fn.t()


def _weighted_stream_sum_into(Xf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """out[b] = sum_j weights[b, j] Xf[b, j]: one batched GEMV [B, 1, C] @ [B, C, D], fp32."""
    out.copy_(torch.bmm(weights.unsqueeze(1), Xf).squeeze(1))


# ---- hc_expand ---------------------------------------------------------------


def _hc_expand_infer(specs, attrs):
    expect_count(specs, 1, "hc_expand")
    require_attrs(attrs, ("hc_mult",), "hc_expand")
    (h,) = specs
    expect_rank(h, 2, "hc_expand h [B, D]")
    expect_spec(h, h.shape, ACTIVATIONS, "hc_expand h")
    expect(int(attrs["hc_mult"]) >= 1, "hc_expand hc_mult", ">= 1", attrs["hc_mult"])
    return [TensorSpec((h.shape[0], int(attrs["hc_mult"]), h.shape[1]), h.dtype)]


def _hc_expand_impl(inputs, outputs, attrs, workspace):
    (h,) = inputs
    (out,) = outputs
    out.copy_(h.unsqueeze(1).expand_as(out))  # [B, C, D]: C identical streams


HC_EXPAND = register(
    OpDef(
        name="hc_expand",
        family="mhc",
        infer=_hc_expand_infer,
        impl=_hc_expand_impl,
        doc="X[:, j] = h for every stream j < hc_mult.",
    )
)


# ---- hc_pre ------------------------------------------------------------------


def _hc_pre_infer(specs, attrs):
    expect_count(specs, 4, "hc_pre")
    require_attrs(attrs, ("eps", "hc_eps", "iters"), "hc_pre")
    X, fn, base, scale = specs
    b, c, d = _streams(X, "hc_pre X")
    mix = (2 + c) * c
    expect_spec(fn, (mix, c * d), F32, "hc_pre fn")
    expect_spec(base, (mix,), F32, "hc_pre base")
    expect_spec(scale, (3,), F32, "hc_pre scale")
    expect(int(attrs["iters"]) >= 1, "hc_pre iters", ">= 1", attrs["iters"])
    return [TensorSpec((b, d), X.dtype), TensorSpec((b, c), F32), TensorSpec((b, c, c), F32)]


def sinkhorn(logits: torch.Tensor, iters: int, hc_eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Spec section 2 step 4: row softmax + eps, column norm, then (iters - 1) x (row, column).

    Two torch forms of the same math, picked by batch (an H200, V4-Flash K=1 chains,
    benchmarks/h200/ab_batch_b8fcadc.txt in git at 873b0e1): one norm kernel per normalisation
    (``_sinkhorn_by_norms``, 45 kernels) for B <= NORMS_MAX_BATCH, where the launches are
    the cost (B=1: 858 against 907 us a replay); a sum and a divide per normalisation
    (``_sinkhorn_by_divisions``, 81 tiny kernels) above it, where the norm kernels' work
    grows with the batch (B=32: 1448 against 1388 us). Under torch.compile, the elementwise
    form. The last step writes ``out`` (when given) instead of a copy afterwards.
    """
    if torch.compiler.is_compiling():
        m = _sinkhorn_elementwise(logits, iters, hc_eps)
        return m if out is None else out.copy_(m)
    if logits.shape[0] <= NORMS_MAX_BATCH:
        return _sinkhorn_by_norms(logits, iters, hc_eps, out)
    return _sinkhorn_by_divisions(logits, iters, hc_eps, out)


# A/B-measured at B=1 (better) and B=32 (worse) only. B=8 with the norms ran 1.180 ms a chain
# (bench_draft, b8fcadc) against 1.213 at e3096ef with the divisions, other changes between.
NORMS_MAX_BATCH = 8


def _sinkhorn_by_divisions(logits, iters: int, hc_eps: float, out=None) -> torch.Tensor:
    """Each normalisation M / (sums + hc_eps) as a sum and an in-place divide: two kernels.

    M lives in the top-left [C, C] block of a [B, C+1, C+1] buffer whose extra column and
    row hold hc_eps: a row sum over all C+1 columns is then sum + hc_eps, a column sum over
    all C+1 rows likewise, and dividing the [C, C] view in place leaves the eps border as
    it was (three kernels otherwise: sum, add, div). The corner is never read. The eps
    joins the sum as one more term: equal to sum + eps within fp32 rounding.
    """
    b, c = logits.shape[0], logits.shape[-1]
    buf = logits.new_full((b, c + 1, c + 1), hc_eps)  # [B, C+1, C+1]
    m = buf[:, :c, :c]  # [B, C, C], rows j, columns k
    torch.add(torch.softmax(logits, dim=-1), hc_eps, out=m)
    rows, cols = buf[:, :c, :], buf[:, :, :c]  # each with its eps border
    for _ in range(iters - 1):  # a static count: unrolled identically in every capture
        m.div_(cols.sum(-2, keepdim=True))
        m.div_(rows.sum(-1, keepdim=True))
    return torch.div(m, cols.sum(-2, keepdim=True), out=out)


def _sinkhorn_by_norms(logits, iters: int, hc_eps: float, out=None) -> torch.Tensor:
    """Each normalisation M / (sums + hc_eps) as one kernel: a norm kernel on square roots.

    With S = sqrt(M), a row of S scaled to S / sqrt(sum S^2 + eps) squares back to
    M / (sum M + eps); that is an RMS norm. Torch's norm kernels that reduce in one launch
    subtract the mean, so the state is the signed block matrix [[S, -S], [-S, S]]: every row
    and every column has mean 0, its variance is the sum of squares over C, and the signs
    survive each step. ``layer_norm`` over the last dim normalises rows; ``batch_norm`` with
    batch statistics, viewing the [2C, B, 2C] state as 2C samples of B*2C channels,
    normalises columns. That makes 39 normalisations plus 5 setup kernels for iters = 20 (its
    three constant vectors are made once: draftgraph.ops.constants); at 9 setup kernels it measured on an
    H200, B=1: 110 us alone against 119 for the divisions, and 39 us off the chain beside the
    MoE (benchmarks/h200/sm_carveout_283311b.txt in git at 873b0e1).
    The state carries a power-of-two scale SIGMA (exact): the norm eps, hc_eps * SIGMA^2 / C,
    stays above cuDNN's batch-norm minimum eps of 1e-5 (below it torch takes its own batch norm,
    not cuDNN's one-kernel path measured here; that fallback was not timed).
    Equal to the divisions within fp32 rounding (tests/test_ops_mhc.py).
    """
    b, c = logits.shape[0], logits.shape[-1]
    s = torch.softmax(logits, dim=-1).add_(hc_eps).sqrt_().permute(1, 0, 2)  # [C (row j), B, C (column k)]
    state = _signed_blocks(s, SINKHORN_SIGMA)  # [2C, B, 2C]
    eps = hc_eps * SINKHORN_SIGMA**2 / c
    gain = constants.full(b * 2 * c, SINKHORN_SIGMA / math.sqrt(c), logits.dtype, logits.device)  # keeps SIGMA
    unscaled = constants.full(b * 2 * c, 1 / math.sqrt(c), logits.dtype, logits.device)  # the last step drops it
    zero = constants.full(b * 2 * c, 0.0, logits.dtype, logits.device)

    def normalise_columns(state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        samples = state.view(2 * c, b * 2 * c, 1)  # batch_norm: stats over dim 0 per channel
        return F.batch_norm(samples, None, None, weight, zero, training=True, eps=eps).view_as(state)

    state = normalise_columns(state, gain if iters > 1 else unscaled)
    for i in range(iters - 1):  # a static count: unrolled identically in every capture
        state = F.layer_norm(state, (2 * c,), gain[: 2 * c], None, eps=eps)
        state = normalise_columns(state, gain if i < iters - 2 else unscaled)
    top_left = state[:c, :, :c].permute(1, 0, 2)  # [B, C, C]: S
    return torch.mul(top_left, top_left, out=out)


SINKHORN_SIGMA = 8.0


def _signed_blocks(s: torch.Tensor, scale: float) -> torch.Tensor:
    """[[S, -S], [-S, S]] * scale as [2C, B, 2C] from S [C, B, C]: one broadcast multiply.

    Laid out as [2 (block row), C, B, 2 (block column), C]: S broadcast over the block dims
    times a constant [2, 1, 1, 2, 1] of signed scales (two kernels when each sign was its own).
    """
    c, b = s.shape[0], s.shape[1]
    signs = constants.values(((scale, -scale), (-scale, scale)), s.dtype, s.device).view(2, 1, 1, 2, 1)
    blocks = torch.mul(s.unsqueeze(0).unsqueeze(3), signs, out=s.new_empty(2, c, b, 2, c))  # contiguous
    return blocks.view(2 * c, b, 2 * c)


def _sinkhorn_elementwise(logits: torch.Tensor, iters: int, hc_eps: float) -> torch.Tensor:
    """The same iteration with every entry a [B] tensor and every sum written out: all of it
    elementwise, so inductor emits one kernel for the whole loop, where sums over the two
    dims of a [B, C, C] tensor cost two reductions (kernels) per iteration. Traced only
    under torch.compile: run eagerly it would be hundreds of launches.
    """
    c = logits.shape[-1]
    soft = torch.softmax(logits, dim=-1) + hc_eps
    m = [[soft[:, j, k] for k in range(c)] for j in range(c)]  # m[j][k]: [B]

    def normalise_columns():
        sums = [sum(m[j][k] for j in range(c)) + hc_eps for k in range(c)]
        return [[m[j][k] / sums[k] for k in range(c)] for j in range(c)]

    m = normalise_columns()
    for _ in range(iters - 1):
        sums = [sum(m[j]) + hc_eps for j in range(c)]
        m = [[m[j][k] / sums[j] for k in range(c)] for j in range(c)]
        m = normalise_columns()
    return torch.stack([torch.stack(row, -1) for row in m], -2)


def _hc_pre_impl(inputs, outputs, attrs, workspace):
    X, fn, base, scale = inputs
    y, post, comb = outputs
    c = X.shape[1]
    hc_eps = float(attrs["hc_eps"])
    Xf = X.float()  # [B, C, D]; read once, before any output (which may share arena bytes) is written
    m = _mix_logits(Xf, fn, float(attrs["eps"]))  # [B, (2+C)*C]
    # The Sinkhorn logits go into comb itself: the side-stream block below reads and writes
    # nothing else of the arena (draftgraph.ops.overlap), and hc_post, its one reader, comes much later.
    # Forked as soon as its logits exist, ahead of y, pre and post.
    torch.addcmul(base[2 * c :], m[:, 2 * c :], scale[2], out=comb.view(-1, c * c))
    with side_stream(urgent=True):  # 45-81 tiny kernels with the torch ops: beside the attention / MoE, not before it
        sinkhorn(comb, int(attrs["iters"]), hc_eps, out=comb)
    # pre and post logits in one op: [B, 2, C] * scale[:2] per group + base.
    gates = torch.sigmoid(torch.addcmul(base[: 2 * c].view(2, c), m[:, : 2 * c].view(-1, 2, c), scale[:2, None]))
    pre = gates[:, 0] + hc_eps  # [B, C]
    torch.mul(gates[:, 1], 2.0, out=post)
    _weighted_stream_sum_into(Xf, pre, y)  # pre is not normalised (spec step 5)


HC_PRE = register(
    OpDef(
        name="hc_pre",
        family="mhc",
        infer=_hc_pre_infer,
        impl=_hc_pre_impl,
        output_names=("y", "post", "comb"),
        deferred=(2,),  # comb: the Sinkhorn may finish on the side stream
        doc="(X, fn, base, scale) -> y = sum_j pre_j X_j, post, comb (Sinkhorn); spec section 2.",
    )
)


# ---- hc_pre_norm (the fold_norm_into_hc_pre pass's op) -------------------------------------


def _hc_pre_norm_infer(specs, attrs):
    expect_count(specs, 5, "hc_pre_norm")
    require_attrs(attrs, ("norm_eps",), "hc_pre_norm")
    y, post, comb = _hc_pre_infer(specs[:4], attrs)
    d, w = y.shape[1], specs[4]
    ok = w.shape == (d,) and w.dtype in (y.dtype, F32)
    expect(ok, "hc_pre_norm norm weight", f"[{d}] of X's dtype or f32", w.short())
    return [y, post, comb]


def _hc_pre_norm_impl(inputs, outputs, attrs, workspace):
    _hc_pre_impl(inputs[:4], outputs, attrs, workspace)
    # Compiled (kernels="compiled"), two graphs as the unfolded ops were: compiled as one, a draft
    # of the small model moved (tests/test_kernels_option.py; inductor fuses y into the norm).
    torch._dynamo.graph_break()
    rms_norm_into(outputs[0], inputs[4], attrs["norm_eps"], outputs[0])


HC_PRE_NORM = register(
    OpDef(
        name="hc_pre_norm",
        family="mhc",
        infer=_hc_pre_norm_infer,
        impl=_hc_pre_norm_impl,
        output_names=("y", "post", "comb"),
        deferred=(2,),  # comb, as hc_pre's
        doc="(X, fn, base, scale, w) -> rms_norm(hc_pre's y, w, norm_eps), post, comb: hc_pre and the norm that "
            "reads its y, folded (runtime/passes/fold_norm_into_hc_pre.py).",
    )
)


# ---- hc_post -----------------------------------------------------------------


def _hc_post_infer(specs, attrs):
    expect_count(specs, 4, "hc_post")
    y, X, post, comb = specs
    b, c, d = _streams(X, "hc_post X")
    expect_spec(y, (b, d), X.dtype, "hc_post y")
    expect_spec(post, (b, c), F32, "hc_post post")
    expect_spec(comb, (b, c, c), F32, "hc_post comb")
    return [X]


def _hc_post_impl(inputs, outputs, attrs, workspace):
    y, X, post, comb = inputs
    (out,) = outputs
    # X'[:, k] = post_k y + sum_j comb[j, k] X[:, j]: the residual is mixed by comb TRANSPOSED.
    # The mix in fp32, then one addcmul adds post_k y (bf16 y promoted inside) and rounds into
    # out: three kernels, where a product, the GEMM on it and a copy out took four. out may
    # alias X: X is read (widened) by the first kernel, out written by the last.
    mixed = torch.bmm(comb.transpose(1, 2), X.float())  # [B, C, D] fp32
    torch.addcmul(mixed, post.unsqueeze(-1), y.unsqueeze(1), out=out)


HC_POST = register(
    OpDef(
        name="hc_post",
        family="mhc",
        infer=_hc_post_infer,
        impl=_hc_post_impl,
        inplace={0: 1},
        doc="X'[:, k] = post_k * y + sum_j comb[j, k] * X[:, j]; may overwrite X.",
    )
)


# ---- hc_head -----------------------------------------------------------------


def _hc_head_infer(specs, attrs):
    expect_count(specs, 4, "hc_head")
    require_attrs(attrs, ("eps", "hc_eps"), "hc_head")
    X, fn, base, scale = specs
    b, c, d = _streams(X, "hc_head X")
    expect_spec(fn, (c, c * d), F32, "hc_head fn")
    expect_spec(base, (c,), F32, "hc_head base")
    expect_spec(scale, (1,), F32, "hc_head scale")
    return [TensorSpec((batch_of(X, "hc_head X"), d), X.dtype)]


def _hc_head_impl(inputs, outputs, attrs, workspace):
    X, fn, base, scale = inputs
    Xf = X.float()  # [B, C, D]
    m = _mix_logits(Xf, fn, float(attrs["eps"]))  # [B, C]
    g = torch.sigmoid(torch.addcmul(base, m, scale)) + float(attrs["hc_eps"])  # [B, C]
    _weighted_stream_sum_into(Xf, g, outputs[0])


HC_HEAD = register(
    OpDef(
        name="hc_head",
        family="mhc",
        infer=_hc_head_infer,
        impl=_hc_head_impl,
        doc="h = sum_j g_j X_j, g = sigmoid(m * scale + base) + hc_eps; no Sinkhorn.",
    )
)
