"""The combiner op against the five nodes of its math (norms, projections, sum) and a float64 reference."""

from __future__ import annotations

import pytest
import torch
from v4_op_cases import CFG, combiner_case, gen, rel_err, run_op

F64 = torch.float64


def ref_combiner(e, h, e_norm, h_norm, e_proj, h_proj, eps):
    """Spec section 5 in float64: h_proj(hnorm(h)) + e_proj(enorm(e)), e's half on every stream."""
    def norm(x, w):
        x = x.to(F64)
        return w.to(F64) * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    e_part = norm(e, e_norm) @ e_proj.to(F64).T
    h_part = norm(h, h_norm) @ h_proj.to(F64).T
    return h_part + (e_part.unsqueeze(1) if h.dim() == 3 else e_part)


@pytest.mark.parametrize("streams", [True, False])
def test_combine_matches_the_float64_reference(streams):
    inputs, attrs = combiner_case(gen(31), streams=streams)
    (out,) = run_op("combiner", inputs, attrs)
    assert out.shape == inputs[1].shape and out.dtype == torch.bfloat16
    assert rel_err(out, ref_combiner(*inputs, attrs["eps"])) < 1e-2


@pytest.mark.parametrize("streams", [True, False])
def test_combine_equals_the_norm_linear_add_nodes_bit_for_bit(streams):
    """The same norms, GEMMs and one rounded sum as rms_norm x2, linear x2, (hc_expand,) add."""
    inputs, attrs = combiner_case(gen(32), streams=streams)
    e, h, e_norm, h_norm, e_proj, h_proj = inputs
    (e_n,) = run_op("rms_norm", [e, e_norm], attrs)
    (h_n,) = run_op("rms_norm", [h, h_norm], attrs)
    (e_p,) = run_op("linear", [e_n, e_proj], {})
    (h_p,) = run_op("linear", [h_n, h_proj], {})
    if streams:
        (e_p,) = run_op("hc_expand", [e_p], {"hc_mult": CFG.hc_mult})
    (want,) = run_op("add", [h_p, e_p], {})
    (out,) = run_op("combiner", inputs, attrs)
    assert torch.equal(out, want)


def test_each_row_combines_its_own_embedding():
    """Row b of the result depends on e[b] and h[b] only (no mixing across the batch)."""
    inputs, attrs = combiner_case(gen(33))
    (out,) = run_op("combiner", inputs, attrs)
    e, h = inputs[0].clone(), inputs[1].clone()
    e[1], h[1] = e[1] * 2 + 1, -h[1]
    (moved,) = run_op("combiner", [e, h, *inputs[2:]], attrs)
    assert torch.equal(moved[0], out[0]) and torch.equal(moved[2], out[2])
    assert not torch.equal(moved[1], out[1])
