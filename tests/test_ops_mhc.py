"""mHC ops against float64 references written from spec section 2."""

from __future__ import annotations

import pytest
import torch
from draftgraph.runtime.ir.op_registry import get_op
from v4_op_cases import (
    CFG,
    gen,
    hc_expand_case,
    hc_head_case,
    hc_post_case,
    hc_pre_case,
    rel_err,
    run_op,
)

F64 = torch.float64


def ref_hc_pre(X, fn, base, scale, eps, hc_eps, iters):
    X, fn, base, scale = (t.to(F64) for t in (X, fn, base, scale))
    b, c, d = X.shape
    x = X.reshape(b, c * d)
    rho = 1 / torch.sqrt((x * x).mean(-1) + eps)  # [B]
    m = (x @ fn.T) * rho[:, None]  # [B, (2+C)*C]
    pre = torch.sigmoid(m[:, :c] * scale[0] + base[:c]) + hc_eps
    post = 2 * torch.sigmoid(m[:, c : 2 * c] * scale[1] + base[c : 2 * c])
    L = torch.empty(b, c, c, dtype=F64)
    for j in range(c):
        for k in range(c):
            L[:, j, k] = m[:, 2 * c + c * j + k] * scale[2] + base[2 * c + c * j + k]
    M = torch.exp(L - L.amax(-1, keepdim=True))
    M = M / M.sum(-1, keepdim=True) + hc_eps  # row softmax over k, + eps
    M = M / (M.sum(1, keepdim=True) + hc_eps)  # column sums: over rows j
    for _ in range(iters - 1):
        M = M / (M.sum(2, keepdim=True) + hc_eps)
        M = M / (M.sum(1, keepdim=True) + hc_eps)
    y = sum(pre[:, j, None] * X[:, j] for j in range(c))
    return y, post, M


def ref_hc_post(y, X, post, comb):
    y, X, post, comb = (t.to(F64) for t in (y, X, post, comb))
    out = torch.empty_like(X)
    for k in range(X.shape[1]):
        out[:, k] = post[:, k, None] * y + sum(comb[:, j, k, None] * X[:, j] for j in range(X.shape[1]))
    return out


def ref_hc_head(X, fn, base, scale, eps, hc_eps):
    X, fn, base, scale = (t.to(F64) for t in (X, fn, base, scale))
    b, c, d = X.shape
    x = X.reshape(b, c * d)
    rho = 1 / torch.sqrt((x * x).mean(-1) + eps)
    g = torch.sigmoid((x @ fn.T) * rho[:, None] * scale[0] + base) + hc_eps  # [B, C]
    return sum(g[:, j, None] * X[:, j] for j in range(c))


def test_hc_expand_copies_h_into_every_stream():
    inputs, attrs = hc_expand_case(gen(1))
    (out,) = run_op("hc_expand", inputs, attrs)
    assert out.shape == (3, CFG.hc_mult, CFG.hidden_size)
    for j in range(CFG.hc_mult):
        assert torch.equal(out[:, j], inputs[0])


def test_hc_pre_matches_float64_reference():
    inputs, attrs = hc_pre_case(gen(2))
    y, post, comb = run_op("hc_pre", inputs, attrs)
    ry, rpost, rcomb = ref_hc_pre(*inputs, **attrs)
    assert y.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    assert rel_err(y, ry) < 5e-3
    assert rel_err(post, rpost) < 1e-5
    assert rel_err(comb, rcomb) < 1e-5


def test_sinkhorn_iteration_count_matters_and_converges():
    inputs, _ = hc_pre_case(gen(3))
    comb_1 = run_op("hc_pre", inputs, hc_pre_case(gen(3), iters=1)[1])[2]
    comb_20 = run_op("hc_pre", inputs, hc_pre_case(gen(3), iters=20)[1])[2]
    assert rel_err(comb_1, ref_hc_pre(*inputs, **hc_pre_case(gen(3), iters=1)[1])[2]) < 1e-5
    assert rel_err(comb_1, comb_20) > 1e-2, "iters=1 and iters=20 should give different mixes"
    ones = torch.ones(3, CFG.hc_mult)
    torch.testing.assert_close(comb_20.sum(-1), ones, atol=1e-3, rtol=0)  # rows
    torch.testing.assert_close(comb_20.sum(-2), ones, atol=1e-3, rtol=0)  # columns
    assert (comb_1.sum(-1) - 1).abs().max() > 1e-2, "one pass leaves rows off 1 (a weak test otherwise)"


def test_hc_pre_does_not_normalise_pre():
    # With pre normalised, y would be a convex mix; sigmoid weights sum to anything in (0, C).
    inputs, attrs = hc_pre_case(gen(4))
    inputs[2] = inputs[2].clone()
    inputs[2][: CFG.hc_mult] = 4.0  # pre ~ 0.98 each: y ~ sum of streams, far from their mean
    y = run_op("hc_pre", inputs, attrs)[0]
    assert rel_err(y, ref_hc_pre(*inputs, **attrs)[0]) < 5e-3
    assert rel_err(y, inputs[0].double().mean(1)) > 0.5


def test_hc_post_mixes_residual_by_comb_transposed():
    inputs, attrs = hc_post_case(gen(5))
    y, X, post, comb = inputs
    assert not torch.allclose(comb, comb.transpose(1, 2)), "the test needs a non-symmetric comb"
    (out,) = run_op("hc_post", inputs, attrs)
    assert rel_err(out, ref_hc_post(*inputs)) < 5e-3
    untransposed = ref_hc_post(y, X, post, comb.transpose(1, 2))
    assert rel_err(out, untransposed) > 0.1


def test_hc_post_is_correct_when_output_aliases_x():
    inputs, attrs = hc_post_case(gen(6))
    ref = ref_hc_post(*inputs)
    X_alias = inputs[1].clone()
    result = get_op("hc_post").impl([inputs[0], X_alias, inputs[2], inputs[3]], [X_alias], attrs, None)
    assert result is None
    assert rel_err(X_alias, ref) < 5e-3
    assert torch.equal(X_alias, run_op("hc_post", inputs, attrs)[0])


def test_hc_head_matches_float64_reference():
    inputs, attrs = hc_head_case(gen(7))
    (out,) = run_op("hc_head", inputs, attrs)
    assert out.shape == (3, CFG.hidden_size) and out.dtype == torch.bfloat16
    assert rel_err(out, ref_hc_head(*inputs, **attrs)) < 5e-3


def test_elementwise_sinkhorn_traced_under_compile_equals_the_eager_one():
    from draftgraph.ops.mhc import _sinkhorn_elementwise, sinkhorn

    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(7)) * 3
    eager = sinkhorn(logits, 20, 1e-6)
    torch.testing.assert_close(_sinkhorn_elementwise(logits, 20, 1e-6), eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(eager.sum(-2), torch.ones(5, 4), rtol=1e-4, atol=1e-4)  # doubly stochastic


def ref_sinkhorn(logits, iters, hc_eps):
    """Spec section 2 step 4 in float64, divisions as written."""
    M = torch.softmax(logits.to(F64), -1) + hc_eps
    M = M / (M.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        M = M / (M.sum(-1, keepdim=True) + hc_eps)
        M = M / (M.sum(-2, keepdim=True) + hc_eps)
    return M


@pytest.mark.parametrize("batch", [1, 3, 8, 9, 32])  # norm kernels up to NORMS_MAX_BATCH, divisions above
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("hc_eps", [1e-6, 1e-2])
def test_sinkhorn_equals_the_spec_divisions_within_fp32_rounding(batch, iters, hc_eps):
    from draftgraph.ops.mhc import sinkhorn

    # Sharp logits: softmax entries far below hc_eps, where the eps terms decide the result.
    logits = torch.randn(batch, 4, 4, generator=torch.Generator().manual_seed(batch * 100 + iters)) * 12
    out = torch.full((batch, 4, 4), float("nan"))
    got = sinkhorn(logits, iters, hc_eps, out=out)
    assert got.data_ptr() == out.data_ptr(), "the last step writes out"
    want = ref_sinkhorn(logits, iters, hc_eps)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-7)
    if hc_eps == 1e-2:  # the eps is honoured, not dropped: without it the result moves far past the tolerance
        assert (want - ref_sinkhorn(logits, iters, 0.0)).abs().max() > 1e-3


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_both_torch_sinkhorn_forms_agree_at_every_batch(batch):
    from draftgraph.ops.mhc import NORMS_MAX_BATCH, _sinkhorn_by_divisions, _sinkhorn_by_norms

    assert 1 <= NORMS_MAX_BATCH < 32
    logits = torch.randn(batch, 4, 4, generator=torch.Generator().manual_seed(batch)) * 5
    torch.testing.assert_close(_sinkhorn_by_norms(logits, 20, 1e-6), _sinkhorn_by_divisions(logits, 20, 1e-6),
                               rtol=2e-5, atol=2e-7)
