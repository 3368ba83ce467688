"""The torch ops on block-scaled weights (issue 28.2, CPU part) and W8A8 (issue 28.4).

On bf16 activations an op on a QuantWeight computes exactly what it computes on the
dequantised weight (the dequantisation is exact and the GEMM the same); W8A8 is held to a
float64 model that rounds the activations the same way (test_native_weights.fp8_round_model).
"""

from __future__ import annotations

import pytest
import torch
from draftgraph.ops import quantised
from draftgraph.ops.quantised import chosen_experts, grouped_linear_t, linear_t
from draftgraph.runtime.execution.kernel_choice import select_impl
from draftgraph.runtime.ir.op_registry import get_op, register_fused
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.quant import quantize_weight
from test_native_weights import fp8_round_model

F64 = torch.float64
FP8 = {"activations": "fp8"}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel(a, b) -> float:
    return float((a.to(F64) - b.to(F64)).norm() / b.to(F64).norm())


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_linear_on_a_quant_weight_is_the_bf16_gemm_on_its_dequantisation(fmt):
    w = quantize_weight(torch.randn(384, 256, generator=gen(1)), fmt)
    x = torch.randn(5, 256, generator=gen(2)).bfloat16()
    assert torch.equal(linear_t(x, w), x @ w.dequantize().t())
    out = torch.empty(5, 384, dtype=torch.bfloat16)
    linear_t(x, w, out=out)
    assert torch.equal(out, x @ w.dequantize().t())


def test_a_large_weight_is_walked_in_row_blocks(monkeypatch):
    # Blocks of 128 rows, each its own GEMM (fp32 accumulation, bf16 out): within bf16 rounding
    # of the float64 product, and no dequantised temporary beyond one block.
    w = quantize_weight(torch.randn(400, 256, generator=gen(3)), "fp8")
    x = torch.randn(3, 256, generator=gen(4)).bfloat16()
    monkeypatch.setattr(quantised, "DEQUANT_CHUNK_BYTES", 128 * 256 * 2)
    seen = []
    real = quantised.dequantize_rows

    def spy(w, start, stop, dtype):
        seen.append((start, stop))
        return real(w, start, stop, dtype)

    monkeypatch.setattr(quantised, "dequantize_rows", spy)
    got = linear_t(x, w)
    assert seen == [(0, 128), (128, 256), (256, 384), (384, 400)]
    want = x.to(F64) @ w.dequantize(F64).t()
    assert torch.allclose(got.to(F64), want, rtol=2**-7, atol=1e-3)
    o = torch.randn(2, 3, 128, generator=gen(5)).bfloat16()  # [G, B, K], the attention's wo_a
    wo = quantize_weight(torch.randn(256, 128, generator=gen(6)), "fp8")
    z = torch.empty(2, 3, 128, dtype=torch.bfloat16)
    grouped_linear_t(o, wo, 2, z)
    want = torch.einsum("gbk,grk->gbr", o.to(F64), wo.dequantize(F64).view(2, 128, 128))
    assert torch.allclose(z.to(F64), want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_w8a8_linear_matches_the_float64_model_of_its_rounding(fmt):
    w = quantize_weight(torch.randn(256, 320, generator=gen(7)), fmt)
    x = (torch.randn(4, 320, generator=gen(8)) * 3).bfloat16()
    got = linear_t(x, w, FP8)
    model = fp8_round_model(x, 128) @ w.dequantize(F64).t()  # activations rounded, GEMM exact
    plain = x.to(F64) @ w.dequantize(F64).t()
    assert rel(got, model) < 2**-8  # bf16 output rounding and fp32 accumulation only
    assert rel(got, plain) > 4 * rel(got, model)  # and it is the rounded model it follows
    assert torch.equal(linear_t(x, w), x @ w.dequantize().t())  # no attr: bf16 activations


def test_the_linear_op_reads_a_quant_weight():
    op = get_op("linear")
    w = quantize_weight(torch.randn(256, 128, generator=gen(9)), "fp8")
    x = torch.randn(3, 128, generator=gen(10)).bfloat16()
    (spec,) = op.infer([TensorSpec.of(x), TensorSpec.of(w)], {})
    assert spec == TensorSpec((3, 256), torch.bfloat16)
    out = torch.empty(3, 256, dtype=torch.bfloat16)
    op.impl([x, w], [out], {}, None)
    assert torch.equal(out, x @ w.dequantize().t())


def test_moe_on_mxfp4_experts_dequantises_only_the_chosen_ones():
    from draftgraph.ops.moe import routed_gather, routed_quantised

    e, inter, dim, k = 8, 64, 128, 2
    w1 = quantize_weight(torch.randn(e, inter, dim, generator=gen(11)) * 0.1, "mxfp4")
    w2 = quantize_weight(torch.randn(e, dim, inter, generator=gen(12)) * 0.1, "mxfp4")
    w3 = quantize_weight(torch.randn(e, inter, dim, generator=gen(13)) * 0.1, "mxfp4")
    x = torch.randn(3, dim, generator=gen(14)).bfloat16()
    idx = torch.tensor([[5, 1], [1, 5], [7, 0]])
    weights = torch.rand(3, k, generator=gen(15)) + 0.5
    chosen = chosen_experts(w1, idx, torch.bfloat16)
    assert chosen.shape == (3, k, inter, dim)
    assert torch.equal(chosen, w1.dequantize()[idx])
    got = routed_quantised(x, idx, weights, w1, w2, w3, 10.0, {})
    want = routed_gather(x, idx, weights, w1.dequantize(), w2.dequantize(), w3.dequantize(), 10.0)
    assert torch.equal(got, want)
    w8a8 = routed_quantised(x, idx, weights, w1, w2, w3, 10.0, FP8)
    assert 0 < rel(w8a8, want) < 0.1  # the activations' FP8 noise, no more


def test_moe_op_with_native_weights_equals_the_op_on_dequantised_weights_gather_path(monkeypatch):
    import draftgraph.ops.moe as moe

    monkeypatch.setattr(moe, "can_grouped_mm", lambda *a: False)  # the bf16 op's gather path: same GEMMs
    e, inter, dim = 8, 64, 128
    x = torch.randn(2, dim, generator=gen(16)).bfloat16()
    gate = (torch.randn(e, dim, generator=gen(17)) * 0.1).bfloat16()
    bias = torch.zeros(e)
    experts = [quantize_weight(torch.randn(*s, generator=gen(18 + i)) * 0.1, "mxfp4")
               for i, s in enumerate([(e, inter, dim), (e, dim, inter), (e, inter, dim)])]
    shared = [quantize_weight(torch.randn(*s, generator=gen(30 + i)) * 0.1, "fp8")
              for i, s in enumerate([(inter, dim), (dim, inter), (inter, dim)])]
    attrs = {"top_k": 2, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0}
    op = get_op("moe")
    specs = [TensorSpec.of(t) for t in (x, gate, bias, *experts, *shared)]
    assert op.infer(specs, attrs) == [TensorSpec((2, dim), torch.bfloat16)]
    native = torch.empty(2, dim, dtype=torch.bfloat16)
    op.impl([x, gate, bias, *experts, *shared], [native], attrs, None)
    plain = torch.empty_like(native)
    op.impl([x, gate, bias, *(w.dequantize() for w in experts + shared)], [plain], attrs, None)
    assert torch.equal(native, plain)


def test_a_node_reading_a_block_scaled_weight_runs_the_torch_op():
    op = get_op("linear")
    fused = object()
    q = TensorSpec.of(quantize_weight(torch.randn(128, 128), "fp8"))
    x = TensorSpec((1, 128), torch.bfloat16)
    try:
        register_fused("linear", "meta", fused)
        meta = torch.device("meta")
        assert select_impl(op, meta, "auto", [x, TensorSpec((128, 128), torch.bfloat16)]) is fused
        assert select_impl(op, meta, "auto", [x, q]) is op.impl
        assert select_impl(op, meta, "torch", [x]) is op.impl
    finally:
        op.fused.pop("meta", None)


def test_moe_pairs_go_a_few_at_a_time_past_the_budget(monkeypatch):
    # V4-Flash's 50 MB a (row, expert) pair: the pairs are dequantised a few at a time there, so the
    # temporaries stay bounded at any batch. Here with a budget of 2 pairs of the small experts.
    from draftgraph.ops.moe import routed_quantised

    e, inter, dim, k = 8, 64, 128, 2
    ws = [quantize_weight(torch.randn(*s, generator=gen(40 + i)) * 0.1, "mxfp4")
          for i, s in enumerate([(e, inter, dim), (e, dim, inter), (e, inter, dim)])]
    x = torch.randn(3, dim, generator=gen(44)).bfloat16()
    idx = torch.tensor([[5, 1], [1, 5], [7, 0]])
    weights = torch.rand(3, k, generator=gen(45)) + 0.5
    whole = routed_quantised(x, idx, weights, *ws, 10.0, {})
    seen = []
    real = quantised.chosen_experts

    def spy(w, chosen, dtype):
        seen.append(chosen.numel())
        return real(w, chosen, dtype)

    monkeypatch.setattr("draftgraph.ops.moe.chosen_experts", spy)
    monkeypatch.setattr(quantised, "EXPERT_PAIRS_BYTES", 2 * 3 * inter * dim * 2)
    chunked = routed_quantised(x, idx, weights, *ws, 10.0, {})
    assert max(seen) == 2 and sum(seen) == 3 * 3 * k  # two pairs at a time, each weight once per pair
    assert rel(chunked, whole) < 1e-6


def test_compiled_kernels_leave_a_block_scaled_node_to_the_torch_op():
    from draftgraph.ops.combiner import project
    from draftgraph.runtime.execution.eager import EagerExecutor
    from draftgraph.runtime.ir.builder import GraphBuilder
    from draftgraph.runtime.ir.tensor_spec import B

    d = 128
    e_proj, h_proj = (quantize_weight(torch.randn(d, d, generator=gen(50 + i)), "fp8") for i in range(2))
    norm = torch.ones(d, dtype=torch.bfloat16)
    b = GraphBuilder("native_combiner")
    e, h = (b.input(n, TensorSpec((B, d), torch.bfloat16)) for n in ("e", "h"))
    weights = {"enorm": norm, "hnorm": norm, "e_proj": e_proj, "h_proj": h_proj}
    refs = [b.weight(n, TensorSpec.of(t)) for n, t in weights.items()]
    z = b.op("combiner", [e, h, *refs], name="combiner", attrs={"eps": 1e-6})
    b.output(b.op("softmax", [z], name="probs"))
    ex = EagerExecutor(b.build(), 2, weights, kernels="compiled")
    impls = {step.node.op: step.impl for step in ex.steps}
    assert impls["combiner"] is get_op("combiner").impl  # not compiled: it reads QuantWeights
    assert impls["softmax"] is not get_op("softmax").impl  # compiled
    es, hs = (torch.randn(2, d, generator=gen(60 + i)).bfloat16() for i in range(2))
    plain = project(es, norm, e_proj.dequantize(), 1e-6) + project(hs, norm, h_proj.dequantize(), 1e-6)
    want = torch.softmax(plain.float(), dim=-1)
    assert torch.allclose(ex.run({"e": es, "h": hs})["probs"].float(), want, atol=1e-2)
