"""The draft chain on weights kept in the checkpoint's formats (issue 28.1, 28.3 CPU part, 28.4).

One small FP8 / MXFP4 checkpoint, the proposer built on it with ``weights="bf16"`` (dequantised at
load) and ``weights="native"`` (as stored): with the reference's FP8 numerics off the native
chain is the bf16 chain bit for bit; with them on (the KV rounding, the default with native
weights; W8A8) hidden and logits stay within quantisation noise and the drafts agree wherever
the bf16 chain's top-2 gap is wider than that noise.
"""

from __future__ import annotations

import math

import pytest
import torch
from draftgraph.runtime.errors import InputError
from draftgraph.runtime.ir.printer import format_graph
from draftgraph.runtime.model.checkpoint_writer import write_checkpoint
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import QuantWeight
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.model.weight_names import linear_kind
from draftgraph.runtime.model.weights import load_checkpoint
from draftgraph.runtime.proposer.binding import weights_nbytes
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from reference_v4 import ReferenceMtp, rms

CFG = V4Config.small()
ROWS, K = 64, 3
F64 = torch.float64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("native_chain") / "mxfp4"
    write_checkpoint(path, CFG, random_mtp_weights(CFG, seed=9), fmt="mxfp4")
    return path


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    hiddens = torch.randn(ROWS, CFG.hc_mult, CFG.hidden_size, generator=gen).bfloat16()
    tokens = torch.randint(CFG.vocab_size, (ROWS,), generator=gen).tolist()
    return tokens, hiddens, [3 + 2 * i for i in range(ROWS)]


def run(checkpoint, batch, device="cpu", **options):
    tokens, hiddens, positions = batch
    hiddens = hiddens.to(device)
    prop = DeepseekV4MtpProposer.from_checkpoint(checkpoint, device=device, **({"executor": "eager"} | options))
    states = [prop.alloc_state() for _ in range(ROWS)]
    first = prop.propose_batch(tokens, hiddens, positions, 1, states)  # K = 1: its hidden is step 0's
    hidden = prop.last_hidden(ROWS).to("cpu", F64)
    for state in states:
        prop.after_verify(0, state)
    drafts = prop.propose_batch(tokens, hiddens, positions, K, states)
    assert [d[0] for d in drafts] == [d[0] for d in first]
    return prop, drafts, hidden


@pytest.fixture(scope="module")
def bf16_run(checkpoint, batch):
    return run(checkpoint, batch, weights="bf16")


@pytest.fixture(scope="module")
def head(checkpoint):
    """Step 0's logits from a chain's pre-hc_head streams, in float64 on the dequantised checkpoint."""
    ref = ReferenceMtp(CFG, load_checkpoint(checkpoint).tensors)

    def logits(streams):
        return torch.stack([ref.w["head.weight"] @ rms(ref.hc_head(s), ref.W("norm.weight"), CFG.rms_norm_eps)
                            for s in streams])

    return logits


def row_errors(got, base) -> torch.Tensor:
    return (got - base).flatten(1).norm(dim=1) / base.flatten(1).norm(dim=1)


def test_cpu_default_is_bf16_and_native_keeps_the_stored_formats(checkpoint, bf16_run):
    default = DeepseekV4MtpProposer.from_checkpoint(checkpoint, executor="eager")
    assert not any(isinstance(t, QuantWeight) for t in default.weights.values())
    assert default.numerics().formats == () and not default.numerics().kv_fp8_round
    native = DeepseekV4MtpProposer.from_checkpoint(checkpoint, executor="eager", weights="native")
    kinds = {n: t.fmt for n, t in native.weights.items() if isinstance(t, QuantWeight)}
    assert kinds["mtp.0.attn.wq_b.weight"] == "fp8" and kinds["mtp.0.ffn.experts.stacked.w1"] == "mxfp4"
    assert native.weights["head.weight"].dtype == torch.bfloat16  # the head is bf16 in the checkpoint
    # No bf16 copy of a block-scaled weight: the bound linears are the stored bytes and scales.
    linears = [n for n in native.weights if linear_kind(n) or ".stacked." in n]
    assert len(linears) == 2 + 5 + 3 + 3 * CFG.n_routed_experts + 3
    assert all(isinstance(native.weights[n], QuantWeight) for n in linears)
    assert weights_nbytes(native.weights) < 0.6 * weights_nbytes(default.weights)
    text = format_graph(native.chain_graph(1))
    assert "f4e2m1x2[16,128,128] scale ue8m0[16,128,8]" in text and "f8e4m3[512,64] scale ue8m0[4,1]" in text
    assert native.numerics().kv_fp8_round  # the reference's KV rounding: the default with native weights


def test_native_without_the_fp8_numerics_is_the_bf16_chain_bit_for_bit(checkpoint, batch, bf16_run):
    _, drafts, hidden = run(checkpoint, batch, weights="native", kv_fp8_round=False)
    _, bf16_drafts, bf16_hidden = bf16_run
    assert drafts == bf16_drafts
    assert torch.equal(hidden, bf16_hidden)


@pytest.mark.parametrize("options, bound", [
    ({}, 0.05),  # native defaults: KV rows rounded through FP8 (one e4m3 rounding of the latent)
    ({"activations": "fp8"}, 0.1),  # and W8A8: ~3.6% rms per rounded input, ten linears a step
])
def test_the_fp8_numerics_stay_within_quantisation_noise(checkpoint, batch, bf16_run, head, options, bound):
    prop, drafts, hidden = run(checkpoint, batch, weights="native", **options)
    _, bf16_drafts, bf16_hidden = bf16_run
    errors = row_errors(hidden, bf16_hidden)
    # Per row, the median: a row whose top-k routing flips under the noise differs by far more.
    assert 0 < float(errors.median()) < bound, errors
    logits, bf16_logits = head(hidden), head(bf16_hidden)
    assert float(row_errors(logits, bf16_logits).median()) < bound
    # A row's noise: its logits move by at most max|d logits|, so its top-2 gap by twice that; 0.06
    # more for the chain's own bf16 head against this float64 one. Wider gaps must keep the draft.
    noise = 2 * (logits - bf16_logits).abs().amax(dim=1) + 0.06
    top = torch.topk(bf16_logits, 2).values
    wide = (top[:, 0] - top[:, 1]) > noise
    assert int(wide.sum()) >= 3, (top[:, 0] - top[:, 1], noise)  # rows enough for the check to mean something
    for row in torch.nonzero(wide).flatten().tolist():
        assert drafts[row][0] == bf16_drafts[row][0], (row, options)


def test_native_default_rounds_the_cached_latents_through_fp8(checkpoint, batch, bf16_run):
    # e4m3 holds 4 significant bits: every non-rotary latent value of a written row has at most 4;
    # bf16 latents (the bf16 default, no rounding) have up to 8.
    n = CFG.head_dim - CFG.qk_rope_head_dim
    native, _, _ = run(checkpoint, batch, weights="native")

    def at_most_4_bits(kv):
        mantissa, _ = torch.frexp(kv.float())
        return (mantissa * 16 == torch.round(mantissa * 16)).all(dim=1)

    for prop, rounded in ((native, True), (bf16_run[0], False)):
        rows = prop.cache.kv[prop.cache.kv.abs().sum(1) > 0]
        assert rows.shape[0] >= ROWS
        assert bool(at_most_4_bits(rows[:, :n]).all()) == rounded
        assert not bool(at_most_4_bits(rows[:, n:]).all())  # the rotary tail is never rounded


def test_bad_options_are_typed_errors_before_any_work(checkpoint):
    for options, what in (({"weights": "fp16"}, "weights"), ({"activations": "int8"}, "activations"),
                          ({"kv_fp8_round": "yes"}, "kv_fp8_round"),
                          ({"weights": "bf16", "activations": "fp8"}, "activations"),
                          ({"activations": "fp8"}, "activations")):  # CPU: weights resolve to bf16
        with pytest.raises(InputError, match=what):
            DeepseekV4MtpProposer(CFG, {}, **options)  # no weights at all: the options fail first


def test_a_checkpoint_with_mixed_expert_formats_is_refused(checkpoint):
    tensors = dict(load_checkpoint(checkpoint, weights="native").tensors)
    name = "mtp.0.ffn.experts.3.w1.weight"
    tensors[name] = tensors[name].dequantize()
    with pytest.raises(InputError, match="experts' formats"):
        DeepseekV4MtpProposer(CFG, tensors, weights="native", executor="eager")


def test_a_weight_whose_format_is_not_the_graphs_is_refused_at_bind(checkpoint):
    from draftgraph.runtime.execution.eager import EagerExecutor

    native = DeepseekV4MtpProposer.from_checkpoint(checkpoint, executor="eager", weights="native")
    bf16 = DeepseekV4MtpProposer.from_checkpoint(checkpoint, executor="eager", weights="bf16")
    with pytest.raises(InputError, match=r"@mtp.0.e_proj.weight.*f8e4m3\[256,256\] scale ue8m0\[2,2\]"):
        EagerExecutor(bf16.chain_graph(1), 1, native.weights, native.state_tensors)


def test_memory_native_against_bf16_on_the_small_checkpoint(checkpoint):
    """The device bytes of the MTP weights, each storage once (per-expert views share the stack)."""
    native = DeepseekV4MtpProposer.from_checkpoint(checkpoint, executor="eager", weights="native")
    bf16 = DeepseekV4MtpProposer.from_checkpoint(checkpoint, executor="eager", weights="bf16")
    c, e = CFG, CFG.n_routed_experts
    d, inter, v = c.hidden_size, c.moe_intermediate_size, c.vocab_size
    expert_params = e * 3 * inter * d
    # bf16: every bf16-kind tensor as stored; the quantised ones at 2 bytes. Native: FP8 1 byte +
    # one scale per 128x128 block; MXFP4 half a byte + one scale per 32.
    fp8_params = 2 * d * d + 3 * inter * d + (c.q_lora_rank * d + c.num_attention_heads * c.head_dim * c.q_lora_rank
                                              + c.head_dim * d + 2 * c.o_groups * c.o_lora_rank * d)
    saved = 2 * (fp8_params + expert_params) - fp8_params - expert_params // 2 - expert_params // 32
    fp8_scales = sum(math.ceil(r / 128) * math.ceil(cc / 128) for r, cc in (
        (d, d), (d, d), (inter, d), (d, inter), (inter, d), (c.q_lora_rank, d),
        (c.num_attention_heads * c.head_dim, c.q_lora_rank), (c.head_dim, d),
        (c.o_groups * c.o_lora_rank, c.num_attention_heads * c.head_dim // c.o_groups),
        (d, c.o_groups * c.o_lora_rank)))
    assert weights_nbytes(bf16.weights) - weights_nbytes(native.weights) == saved - fp8_scales
    assert weights_nbytes(bf16.weights) > 2 * v * d * 2  # embed + head are in both


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [{}, {"activations": "fp8"}], ids=["w8a16", "w8a8"])
def test_native_is_the_cuda_default_and_captured_replay_equals_eager_bit_for_bit(checkpoint, batch, options):
    # W8A8 at 64 rows: the rounding launches (fp8_round_rows) and wq_b on the FP8 tensor cores
    tokens, hiddens, positions = batch
    results = []
    for executor in ("eager", "captured"):
        prop = DeepseekV4MtpProposer.from_checkpoint(checkpoint, device="cuda", executor=executor,
                                                     poison_arena=True, **options)
        assert any(isinstance(t, QuantWeight) for t in prop.weights.values()) and prop.numerics().kv_fp8_round
        states = [prop.alloc_state() for _ in range(ROWS)]
        drafts = prop.propose_batch(tokens, [h.cuda() for h in hiddens], positions, K, states)
        results.append((drafts, prop.last_hidden(ROWS).cpu(), prop.cache.kv.cpu()))
    (d0, h0, kv0), (d1, h1, kv1) = results
    assert d0 == d1 and torch.equal(h0, h1) and torch.equal(kv0, kv1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options, bound", [({}, 0.05), ({"activations": "fp8"}, 0.1)], ids=["w8a16", "w8a8"])
def test_native_on_cuda_within_quantisation_noise_of_bf16_with_fused_kernels(checkpoint, batch, head, monkeypatch,
                                                                             options, bound):
    # kernels="auto": every op runs its fused Triton kernels, the block-scaled ones fp8_gemv and moe_mxfp4
    # (issue 28.2): each node reading a QuantWeight is bound to the op's fused CUDA impl, which never
    # falls back to the torch op inside (a wrapper counts such calls and runs them).
    import draftgraph.ops.attention
    import draftgraph.ops.basic
    import draftgraph.ops.combiner
    import draftgraph.ops.moe
    from draftgraph.runtime.ir.op_registry import get_op

    fallbacks = []
    for module, fn in [(draftgraph.ops.basic, "_linear_impl"), (draftgraph.ops.combiner, "_combiner_impl"),
                       (draftgraph.ops.attention, "_attn_impl"), (draftgraph.ops.moe, "_moe_impl"),
                       (draftgraph.ops.moe, "_moe_hash_impl")]:
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, fn=fn, real=real: fallbacks.append(fn) or real(*a))
    _, bf16_drafts, bf16_hidden = run(checkpoint, batch, "cuda", weights="bf16", executor="captured")
    fallbacks.clear()  # the bf16 run's are not this test's subject
    prop, drafts, hidden = run(checkpoint, batch, "cuda", executor="captured", **options)  # CUDA default: native
    assert prop.options.weights_on(prop.device) == "native" and prop.numerics().kv_fp8_round
    native_nodes = []
    for executor in prop._executors.values():
        eager = getattr(executor, "eager", executor)
        for step in eager.steps:
            specs = [eager.graph.values[n].spec for n in step.node.inputs if n in eager.graph.values]
            if any(s.is_quantised for s in specs):
                native_nodes.append(step.node.op)
                assert step.impl is get_op(step.node.op).fused["cuda"], (step.node.name, step.impl)
    assert {"embed_combiner", "swa_attention", "moe"} <= set(native_nodes), native_nodes  # the pass folds embed in
    assert fallbacks == [], fallbacks
    assert float(row_errors(hidden, bf16_hidden).median()) < bound
    logits, bf16_logits = head(hidden), head(bf16_hidden)
    noise = 2 * (logits - bf16_logits).abs().amax(dim=1) + 0.06
    top = torch.topk(bf16_logits, 2).values
    for row in torch.nonzero((top[:, 0] - top[:, 1]) > noise).flatten().tolist():
        assert drafts[row][0] == bf16_drafts[row][0], row
