"""The FP8 draft head (issue 28.5, ``ProposerOptions.head_dtype="fp8"``).

The head's rows are quantised at load to FP8 e4m3 with 128 x 128 UE8M0 scales, for drafting only.
Oracles: float64 logits on the dequantised head (the torch op and the fused kernel, under the
interpreter on CPU, must compute exactly those up to fp32 accumulation); a proposer with the bf16
head (drafts must agree wherever the bf16 logits' top-2 gap is wider than the head's quantisation
moved them); the floor's head bytes written out by hand from the format.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from draftgraph.ops import lm_head as lm_head_mod
from draftgraph.runtime.errors import InputError
from draftgraph.runtime.execution.kernel_choice import block_scaled_gap
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import QuantWeight, quantize_weight
from draftgraph.runtime.proposer.binding import quantise_head
from proposer_fixtures import SMALL, make_proposer
from reference_v4 import ReferenceMtp, rms

F64 = torch.float64
EPS = 1e-6
ROOT = Path(__file__).resolve().parents[1]


def head_case(batch: int, vocab: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(batch, dim, generator=gen) * 3).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(dim, generator=gen)).bfloat16()
    head = (torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)).bfloat16()
    return h, norm_w, head


def reference_logits(h, norm_w, w: QuantWeight, rows: int) -> torch.Tensor:
    """float64 logits on the dequantised head, from the normed input rounded to bf16 as the op rounds it."""
    x = h.to(F64)
    normed = (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.to(F64)).bfloat16().to(F64)
    return normed @ w.dequantize(torch.float32).to(F64)[:rows].t()


def test_quantise_head_is_block_by_block_quantize_fp8():
    _, _, head = head_case(1, 1000, 256)
    w = quantise_head(head)
    whole = quantize_weight(head, "fp8")
    assert w.fmt == "fp8" and w.data.shape == (1000, 256) and w.scale.shape == (8, 2)
    assert torch.equal(w.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(w.scale.view(torch.uint8), whole.scale.view(torch.uint8))
    rel = (w.dequantize(torch.float32) - head.float()).norm() / head.float().norm()
    assert 0 < float(rel) < 0.05, float(rel)  # e4m3: ~2-3% rms


@pytest.mark.parametrize("batch, vocab_rows", [(1, 0), (3, 700)])
def test_torch_op_on_an_fp8_head_against_float64(batch, vocab_rows, monkeypatch):
    h, norm_w, head = head_case(batch, 5000, 128, seed=batch)
    w = quantise_head(head)
    rows = vocab_rows or 5000
    read = []
    real = lm_head_mod.dequantize_rows
    monkeypatch.setattr(lm_head_mod, "dequantize_rows", lambda q, a, b, dt: read.append(b - a) or real(q, a, b, dt))
    logits = torch.full((batch, rows), float("nan"))  # poisoned: every element must be written
    lm_head_mod._lm_head_impl([h, norm_w, w], [logits], {"eps": EPS, "vocab_rows": vocab_rows}, None)
    ref = reference_logits(h, norm_w, w, rows)
    assert torch.allclose(logits.to(F64), ref, rtol=1e-5, atol=1e-5), (logits.to(F64) - ref).abs().max()
    # Dequantised a chunk of rows at a time, never the whole head; and only the vocab_rows rows.
    assert max(read) <= lm_head_mod.QUANT_ROWS_PER_CHUNK < 5000 and sum(read) == rows, read


def test_infer_takes_the_fp8_head_spec():
    h, norm_w, head = head_case(2, 300, 256)
    w = quantise_head(head)
    specs = [TensorSpec.of(h), TensorSpec.of(norm_w), TensorSpec.of(w)]
    assert specs[2].quant == "fp8"
    (out,) = lm_head_mod.LM_HEAD.infer(specs, {"eps": EPS, "vocab_rows": 200})
    assert out == TensorSpec((2, 200), torch.float32)


def test_fused_impl_reads_fp8_heads_only():
    from draftgraph.ops.triton import head as head_kernels

    h, norm_w, head = head_case(1, 256, 128)
    base = [TensorSpec.of(h), TensorSpec.of(norm_w)]
    fp8 = base + [TensorSpec.of(quantise_head(head))]
    mxfp4 = base + [TensorSpec.of(quantize_weight(head, "mxfp4"))]
    assert block_scaled_gap(head_kernels.lm_head_impl, fp8) is None  # kernel_choice binds the fused impl
    assert "FP8 only" in block_scaled_gap(head_kernels.lm_head_impl, mxfp4)  # the torch op instead
    assert block_scaled_gap(head_kernels.lm_head_impl, base + [TensorSpec.of(head)]) is None


@pytest.mark.parametrize("batch, vocab_rows, prologue", [(1, 0, False), (3, 200, False), (2, 0, True)])
def test_fused_impl_on_an_fp8_head_under_the_interpreter(batch, vocab_rows, prologue, monkeypatch):
    from draftgraph.ops.triton import fp8_linear
    from draftgraph.ops.triton import head as head_kernels

    monkeypatch.setattr(head_kernels, "LM_HEAD_PROLOGUE", prologue)
    calls = []
    real_gemv = fp8_linear.fp8_gemv
    monkeypatch.setattr(fp8_linear, "fp8_gemv", lambda *a, **kw: calls.append(kw) or real_gemv(*a, **kw))
    h, norm_w, head = head_case(batch, 300, 256, seed=7 + batch)  # 300: a partial last scale block
    w = quantise_head(head)
    rows = vocab_rows or 300
    logits = torch.full((batch, rows), float("nan"))
    head_kernels.lm_head_impl([h, norm_w, w], [logits], {"eps": EPS, "vocab_rows": vocab_rows}, None)
    # The kernels round the normed row to bf16 in their own order (rms_norm_rows, or the prologue):
    # against the unrounded float64 norm each input is off by at most 2^-8 relative (two roundings),
    # so each logit by at most 2^-8 * sum_i |n_i w_i|, plus fp32 accumulation.
    x = h.to(F64)
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.to(F64)  # [B, D]
    dense = w.dequantize(torch.float32).to(F64)[:rows]  # [Vd, D]
    ref = normed @ dense.t()
    bound = 2.0**-8 * (normed.abs() @ dense.abs().t()) + 1e-5
    err = (logits.to(F64) - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # the fp32 / bf16 path is not the float64 one: the check compares something
    assert len(calls) == 1 and ("norm_w" in calls[0]) == prologue  # the FP8 kernel ran, not the torch op


def test_fp8_head_tiles_count_its_outputs_past_16_rows(monkeypatch):
    """Past 16 rows the head's tiles come from the wide-grid rule on its own outputs (it was asked
    with no outputs, so it always took the 32-row tiles): a vocab of 128 64-row tiles takes the wide
    ones, one tile fewer the 32-row ones."""
    from draftgraph.ops.triton import fp8_linear
    from draftgraph.ops.triton import head as head_kernels

    configs = []
    monkeypatch.setattr(fp8_linear, "fp8_gemv", lambda *a, **kw: configs.append(kw["config"]))
    wide = fp8_linear.WIDE_GRID_PROGRAMS * fp8_linear.WIDE_GRID_CONFIG.block_n
    h, norm_w, head = head_case(32, wide, 128)
    w = quantise_head(head)
    for rows in (wide, wide - fp8_linear.WIDE_GRID_CONFIG.block_n):
        logits = torch.empty(32, rows)
        head_kernels.lm_head_impl([h, norm_w, w], [logits], {"eps": EPS, "vocab_rows": rows}, None)
    assert configs == [fp8_linear.WIDE_GRID_CONFIG, fp8_linear.LARGE_BATCH_CONFIG], configs


# ---- the option, end to end -------------------------------------------------------------------


ROWS = 64


@pytest.fixture(scope="module")
def drafts_by_head():
    gen = torch.Generator().manual_seed(0)
    hiddens = torch.randn(ROWS, SMALL.hc_mult, SMALL.hidden_size, generator=gen).bfloat16()
    tokens = torch.randint(SMALL.vocab_size, (ROWS,), generator=gen).tolist()
    positions = [3 + 2 * i for i in range(ROWS)]
    out = {}
    for head_dtype in ("bf16", "fp8"):
        prop = make_proposer(SMALL, seed=5, head_dtype=head_dtype)
        states = [prop.alloc_state() for _ in range(ROWS)]
        drafts = prop.propose_batch(tokens, hiddens, positions, 1, states)
        out[head_dtype] = (prop, [d[0] for d in drafts], prop.last_hidden(ROWS).to(F64))
    return out


def test_fp8_head_proposer_binds_a_quantised_head_and_a_bf16_embedding(drafts_by_head):
    prop, _, _ = drafts_by_head["fp8"]
    bf16, _, _ = drafts_by_head["bf16"]
    assert isinstance(prop.weights["head.weight"], QuantWeight) and prop.weights["head.weight"].fmt == "fp8"
    assert prop.weights["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(prop.weights["embed.weight"], bf16.weights["embed.weight"])
    # The head's format is not the checkpoint's: a bf16 checkpoint keeps bf16 numerics elsewhere.
    assert prop.numerics().formats == (("head.weight", "fp8"),) and not prop.numerics().kv_fp8_round
    text = format_graph(prop.chain_graph(1))
    assert "@head.weight: f8e4m3[1000,256] scale ue8m0[8,2]" in text
    assert "@head.weight: bf16[1000,256]" in format_graph(bf16.chain_graph(1))


def test_fp8_head_drafts_agree_where_the_top2_gap_exceeds_the_logit_change(drafts_by_head):
    prop8, drafts8, hidden8 = drafts_by_head["fp8"]
    prop16, drafts16, hidden16 = drafts_by_head["bf16"]
    assert torch.equal(hidden8, hidden16)  # the head does not feed the step's hidden

    def logits(prop, streams):
        """Step 0's logits in float64 from the chain's pre-hc_head streams, on the head the chain bound."""
        w = prop.weights["head.weight"]
        w = (w.dequantize(torch.float32) if isinstance(w, QuantWeight) else w).to(F64)
        names = ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight")
        ref = ReferenceMtp(SMALL, {f"mtp.0.{n}": prop.weights[f"mtp.0.{n}"] for n in names})
        return torch.stack([w @ rms(ref.hc_head(s), ref.W("norm.weight"), SMALL.rms_norm_eps) for s in streams])

    l8, l16 = logits(prop8, hidden8), logits(prop16, hidden16)
    change = (l8 - l16).abs().amax(dim=1)
    assert float(change.min()) > 0  # the head did change
    top = torch.topk(l16, 2).values
    gap = top[:, 0] - top[:, 1]
    wide = gap > 2 * change + 0.06  # 0.06: the chain's bf16 head against this float64 one
    agree = sum(a == b for a, b in zip(drafts8, drafts16))
    print(f"fp8 head: {agree}/{ROWS} drafts equal to the bf16 head's; {int(wide.sum())} rows with a wide gap")
    assert int(wide.sum()) >= ROWS // 4, (gap, change)
    for row in torch.nonzero(wide).flatten().tolist():
        assert drafts8[row] == drafts16[row], row


def test_fp8_head_chain_on_the_fused_lm_head_drafts_as_the_torch_op(monkeypatch):
    """The chain's lm_head step bound to the fused impl (as kernel_choice binds it on CUDA), under the
    interpreter: one fp8_gemv a step, no torch fallback, drafts equal to the torch op's wherever the
    float64 top-2 gap exceeds the norm's bf16 rounding noise (0.06, as test_native_proposer)."""
    from draftgraph.ops.triton import fp8_linear
    from draftgraph.ops.triton import head as head_kernels

    rows = 16
    gen = torch.Generator().manual_seed(4)
    hiddens = torch.randn(rows, SMALL.hc_mult, SMALL.hidden_size, generator=gen).bfloat16()
    tokens = torch.randint(SMALL.vocab_size, (rows,), generator=gen).tolist()
    positions = [5 + 3 * i for i in range(rows)]

    def propose(fused: bool):
        prop = make_proposer(SMALL, seed=5, head_dtype="fp8", kernels="torch", buckets=(rows,))
        executor = prop._executor(rows, 1, False)
        for step in executor.steps:
            if step.node.op == "lm_head" and fused:
                specs = [executor.graph.values[n].spec for n in step.node.inputs]
                assert block_scaled_gap(head_kernels.lm_head_impl, specs) is None
                step.impl = head_kernels.lm_head_impl
        states = [prop.alloc_state() for _ in range(rows)]
        drafts = prop.propose_batch(tokens, hiddens, positions, 1, states)
        return prop, [d[0] for d in drafts], prop.last_hidden(rows).to(F64)

    prop, want, hidden = propose(False)
    calls = []
    real_gemv = fp8_linear.fp8_gemv
    monkeypatch.setattr(fp8_linear, "fp8_gemv", lambda *a, **kw: calls.append(1) or real_gemv(*a, **kw))
    monkeypatch.setattr(lm_head_mod, "_lm_head_impl", lambda *a: pytest.fail("torch fallback"))
    _, got, got_hidden = propose(True)
    assert len(calls) == 1 and torch.equal(hidden, got_hidden)
    w = prop.weights["head.weight"].dequantize(torch.float32).to(F64)
    names = ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight")
    ref = ReferenceMtp(SMALL, {f"mtp.0.{n}": prop.weights[f"mtp.0.{n}"] for n in names})
    logits = torch.stack([w @ rms(ref.hc_head(s), ref.W("norm.weight"), SMALL.rms_norm_eps) for s in hidden])
    top = torch.topk(logits, 2).values
    wide = (top[:, 0] - top[:, 1]) > 0.06
    assert int(wide.sum()) >= 4, top
    for row in torch.nonzero(wide).flatten().tolist():
        assert got[row] == want[row] == int(logits[row].argmax()), row


def test_kernel_choice_binds_the_fused_lm_head_to_an_fp8_head_only():
    from draftgraph.ops.triton import head as head_kernels
    from draftgraph.runtime.execution.kernel_choice import select_impl
    from draftgraph.runtime.ir.op_registry import get_op, register_fused

    op = get_op("lm_head")
    h, norm_w, head = head_case(1, 256, 128)
    base = [TensorSpec.of(h), TensorSpec.of(norm_w)]
    register_fused("lm_head", "meta", head_kernels.lm_head_impl)  # as register_all does for CUDA
    try:
        meta = torch.device("meta")
        assert select_impl(op, meta, "auto", base + [TensorSpec.of(quantise_head(head))]) is head_kernels.lm_head_impl
        assert select_impl(op, meta, "auto", base + [TensorSpec.of(quantize_weight(head, "mxfp4"))]) is op.impl
        assert select_impl(op, meta, "auto", base + [TensorSpec.of(head)]) is head_kernels.lm_head_impl
    finally:
        op.fused.pop("meta", None)


def test_a_bad_head_dtype_is_a_typed_error():
    for value in ("fp4", "int8", None):
        with pytest.raises(InputError, match="head_dtype"):
            make_proposer(SMALL, head_dtype=value)


# ---- the floor ----------------------------------------------------------------------------------


def test_floor_with_an_fp8_head_from_the_specs():
    spec = importlib.util.spec_from_file_location("bench_floor", ROOT / "benchmarks" / "bench_floor.py")
    bench_floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_floor)
    cfg = V4Config.flash()
    v, d = cfg.vocab_size, cfg.hidden_size
    bf16 = bench_floor.step_weight_bytes(cfg, graph=bench_floor.floor_graph(cfg, "mxfp4"))
    fp8 = bench_floor.step_weight_bytes(cfg, graph=bench_floor.floor_graph(cfg, "mxfp4", head_dtype="fp8"))
    assert bf16["lm head"] == v * d * 2
    assert fp8["lm head"] == v * d + math.ceil(v / 128) * math.ceil(d / 128)
    assert {k: x for k, x in fp8.items() if k != "lm head"} == {k: x for k, x in bf16.items() if k != "lm head"}
    assert 0.77e9 < sum(fp8.values()) < 0.79e9 and 1.30e9 < sum(bf16.values()) < 1.32e9


# ---- CUDA (written without a GPU: never run) -------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_fp8_head_at_flash_shapes_against_the_torch_op():
    from draftgraph.ops.triton import head as head_kernels

    cfg = V4Config.flash()
    h, norm_w, head = (t.cuda() for t in head_case(4, cfg.vocab_size, cfg.hidden_size))
    w = quantise_head(head)
    for batch in (1, 4):
        got = torch.full((batch, cfg.vocab_size), float("nan"), device="cuda")
        want = torch.empty_like(got)
        args = ({"eps": EPS, "vocab_rows": 0}, None)
        head_kernels.lm_head_impl([h[:batch], norm_w, w], [got], *args)
        lm_head_mod._lm_head_impl([h[:batch], norm_w, w], [want], *args)
        err = (got - want).abs().max() / want.abs().max()
        assert float(err) < 1e-2, float(err)  # the norms' bf16 roundings differ by an ulp, nothing else
        assert float((got.argmax(1) == want.argmax(1)).float().mean()) >= 0.75


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_head_on_cuda_binds_the_fused_head_and_replays_as_eager():
    from draftgraph.ops.triton import head as head_kernels

    gen = torch.Generator().manual_seed(0)
    hiddens = torch.randn(8, SMALL.hc_mult, SMALL.hidden_size, generator=gen).bfloat16().cuda()
    tokens, positions = torch.randint(SMALL.vocab_size, (8,), generator=gen).tolist(), [3 + i for i in range(8)]
    results = []
    for executor in ("eager", "captured"):
        prop = make_proposer(SMALL, seed=5, head_dtype="fp8", device="cuda", executor=executor)
        states = [prop.alloc_state() for _ in range(8)]
        results.append(prop.propose_batch(tokens, hiddens, positions, 3, states))
        for ex in prop._executors.values():
            eager = getattr(ex, "eager", ex)
            impls = [s.impl for s in eager.steps if s.node.op == "lm_head"]
            assert impls and all(i is head_kernels.lm_head_impl for i in impls), impls
    assert results[0] == results[1]
