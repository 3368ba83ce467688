"""The fused Triton kernels against their torch ops.

Without CUDA the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``) at the
small test shapes; with CUDA the ``cuda``-marked tests run them compiled, at the small and
at the V4-Flash shapes. Each check draws fresh random inputs (never zeros), poisons the
outputs with NaN, and compares by relative error against the torch op run on fp32 copies of
the inputs (the same function without bf16 intermediates): the fused result must be about
as close to it as the bf16 torch op is.
"""

from __future__ import annotations

import math

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import HAS_CUDA, INTERPRET, load_kernel_modules

K = load_kernel_modules(
    ["_common", "fp8_round", "gemv", "fp8_linear", "combiner", "head", "moe_grouped", "moe_mxfp4", "moe", "mhc",
     "attention", "gate"]  # fmt: skip
)

from draftgraph.graphs.v4_block import CacheGeometry, attention_attrs  # noqa: E402
from draftgraph.runtime.ir.op_registry import get_op  # noqa: E402
from draftgraph.runtime.ir.tensor_spec import TensorSpec  # noqa: E402
from draftgraph.runtime.model.config import V4Config  # noqa: E402
from v4_op_cases import (  # noqa: E402
    attention_case,
    combiner_case,
    draft_argmax_case,
    gen,
    hc_head_case,
    hc_post_case,
    hc_pre_case,
    hc_pre_norm_case,
    lm_head_case,
    moe_case,
    moe_hash_case,
    rel_err,
)

FUSED = {
    "lm_head": K["head"].lm_head_impl,
    "draft_argmax": K["head"].draft_argmax_impl,
    "moe": K["moe"].moe_impl,
    "moe_hash": K["moe"].moe_hash_impl,
    "hc_pre": K["mhc"].hc_pre_impl,
    "hc_pre_norm": K["mhc"].hc_pre_norm_impl,
    "hc_head": K["mhc"].hc_head_impl,
    "hc_post": K["mhc"].hc_post_impl,
    "swa_attention": K["attention"].swa_attention_impl,
    "linear": K["gemv"].linear_impl,
    "rms_norm": K["gemv"].rms_norm_impl,
    "combiner": K["combiner"].combiner_impl,
    "draft_gate": K["gate"].draft_gate_impl,
    "cut_drafts": K["gate"].cut_drafts_impl,
}
MUTATED = {"swa_attention": (9,)}  # inputs an op writes (the KV cache)

cpu_only = pytest.mark.skipif(not INTERPRET, reason="the interpreter tests run where there is no CUDA")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# ---- running an op three ways -----------------------------------------------------------------


def _outputs(name, inputs, attrs, device):
    specs = get_op(name).infer([TensorSpec.of(t) for t in inputs], attrs)
    outs = []
    for s in specs:
        fill = float("nan") if s.dtype.is_floating_point else -7
        outs.append(torch.full(s.shape, fill, dtype=s.dtype, device=device))
    return outs


def _run(name, impl, inputs, attrs):
    # Only the inputs an op writes (the cache) are cloned: the V4-Flash experts are 13 GB.
    written = MUTATED.get(name, ())
    inputs = [t.clone() if i in written else t for i, t in enumerate(inputs)]
    outs = _outputs(name, inputs, attrs, inputs[0].device)
    assert impl(inputs, outs, attrs, None) is None
    return outs, inputs


def _upcast(t):
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def compare(name, inputs, attrs, slack=2.0, floor=2e-3, limit=1.5e-2):
    """Run the fused impl, the torch op, and the torch op on fp32 copies; check the errors.

    Returns (fused outputs, fused inputs after the run, errors of fused and torch vs fp32).
    """
    fused, fused_in = _run(name, FUSED[name], inputs, attrs)
    torch_out, torch_in = _run(name, get_op(name).impl, inputs, attrs)
    ref, ref_in = _run(name, get_op(name).impl, [_upcast(t) for t in inputs], attrs)
    errs = []
    for i, (f, t, r) in enumerate(zip(fused, torch_out, ref)):
        if not f.is_floating_point():
            assert torch.equal(f, t), (name, i, f, t)
            continue
        assert not torch.isnan(f).any(), f"{name} output {i}: unwritten (NaN) elements"
        e_f, e_t = rel_err(f, r), rel_err(t, r)
        errs.append((e_f, e_t))
        assert e_f <= max(slack * e_t, floor) and e_f < limit, (
            f"{name} output {i}: fused {e_f:.2e} torch {e_t:.2e}"
        )
    for idx in MUTATED.get(name, ()):
        e_f, e_t = rel_err(fused_in[idx], ref_in[idx]), rel_err(torch_in[idx], ref_in[idx])
        assert e_f <= max(slack * e_t, floor), f"{name} state {idx}: fused {e_f:.2e} torch {e_t:.2e}"
    return fused, fused_in, errs


def to_device(case, device):
    inputs, attrs = case
    return [t.to(device) for t in inputs], attrs


# ---- the small shapes, under the interpreter or on the GPU -------------------------------------

DEVICES = [pytest.param("cpu", marks=cpu_only), pytest.param("cuda", marks=[cuda, needs_cuda])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_rows", [0, 700])
def test_lm_head(device, vocab_rows):
    compare("lm_head", *to_device(lm_head_case(gen(101), vocab_rows=vocab_rows), device))


@cpu_only
def test_lm_head_past_16_rows():
    """Past 16 rows the bf16 head takes its own dot tiles (head.LM_HEAD_LARGE_BATCH_CONFIG); on the
    GPU the captured chain at B=32 runs them (benchmarks/h200/pytest_cuda_35c6e90_h100.txt)."""
    head = K["head"]
    assert head.head_config(17) is head.LM_HEAD_LARGE_BATCH_CONFIG and head.head_config(16) is not head.head_config(17)
    compare("lm_head", *lm_head_case(gen(103), batch=20, vocab_rows=700))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_mask,limit", [(False, None), (True, None), (True, 777), (False, 0)])
def test_draft_argmax(device, with_mask, limit):
    inputs, attrs = to_device(draft_argmax_case(gen(102), with_mask=with_mask, limit=limit), device)
    fused, _ = _run("draft_argmax", FUSED["draft_argmax"], inputs, attrs)
    ref, _ = _run("draft_argmax", get_op("draft_argmax").impl, inputs, attrs)
    assert torch.equal(fused[0], ref[0]), (fused[0], ref[0])
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_draft_argmax_edges(device):
    inputs, attrs = draft_argmax_case(gen(103), with_mask=True)
    logits, limit, mask = inputs
    mask.zero_()
    mask[1, 0] = -(2**31)  # row 1: only token 31 (bit 31 of word 0)
    mask[2] = -1  # row 2: everything, with a three-way tie at the top
    logits[2, [17, 400, 901]] = 50.0
    inputs = [t.to(device) for t in (logits, limit, mask)]
    fused, _ = _run("draft_argmax", FUSED["draft_argmax"], inputs, attrs)
    assert fused[0].tolist() == [0, 31, 17]
    assert fused[1][0].item() == 0.0 and fused[1][1].item() == 1.0
    assert abs(fused[1][2].item() - 1 / 3) < 1e-6


def gate_case(g, batch, with_alive):
    prob = torch.rand(batch, generator=g)
    prob[0] = float("nan")  # stops its row
    positions = torch.randint(0, 50, (batch,), generator=g)
    kv_start = torch.zeros(batch, dtype=torch.int32)
    kv_start[-1], positions[-1] = 1, 0  # the last row is padding
    inputs = [prob, positions, kv_start]
    if with_alive:
        inputs.append(torch.randint(0, 2, (batch,), generator=g, dtype=torch.int32))
    return inputs, {"tau": 0.4}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,with_alive", [(1, False), (5, True), (33, True), (64, False)])
def test_draft_gate_equals_the_torch_op(device, batch, with_alive):
    inputs, attrs = to_device(gate_case(gen(104 + batch), batch, with_alive), device)
    fused, _ = _run("draft_gate", FUSED["draft_gate"], inputs, attrs)
    ref, _ = _run("draft_gate", get_op("draft_gate").impl, inputs, attrs)
    assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1]), (fused, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_draft_gate_go_ignores_padded_rows(device):
    inputs = [torch.tensor([0.1, 0.9]), torch.tensor([7, 0]), torch.tensor([0, 1], dtype=torch.int32)]
    fused, _ = _run("draft_gate", FUSED["draft_gate"], [t.to(device) for t in inputs], {"tau": 0.5})
    assert fused[0].tolist() == [0, 1] and fused[1].tolist() == [0]  # only the padded row is alive


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,k,in_place", [(1, 2, True), (3, 4, False), (17, 8, True), (2, 9, True)])
def test_cut_drafts_equals_the_torch_op(device, batch, k, in_place):
    g = gen(120 + k)
    drafts = torch.randint(0, 1000, (batch, k), generator=g)
    steps = []
    for _ in range(k - 1):
        steps += [torch.randint(0, 2, (batch,), generator=g, dtype=torch.int32),
                  torch.randint(0, 2, (1,), generator=g, dtype=torch.int32)]
    inputs = [t.to(device) for t in [drafts, *steps]]
    outs = {}
    for name, impl in (("fused", FUSED["cut_drafts"]), ("torch", get_op("cut_drafts").impl)):
        src = inputs[0].clone()
        out = src if in_place else torch.full_like(src, -7)
        assert impl([src, *inputs[1:]], [out], {}, None) is None
        outs[name] = out
    assert torch.equal(outs["fused"], outs["torch"]), outs
    assert (outs["fused"][:, 0] == drafts[:, 0].to(device)).all()  # the first draft is always kept


GEMV = K["gemv"].GemvConfig
MOE_VARIANTS = {  # (W13_CONFIG, W2_CONFIG) at batch 1: the tensor-core and the FMA kernels
    "dot": (GEMV(64, 64, 4, 5), GEMV(16, 512, 4, 3)),
    "fma": (GEMV(8, 128, 4, 3, False), GEMV(8, 128, 4, 3, False)),
}


@pytest.mark.parametrize("device", DEVICES)
def test_moe(device):
    compare("moe", *to_device(moe_case(gen(104), batch=2), device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_moe_batch_one_variants(device, variant, monkeypatch):
    w13, w2 = MOE_VARIANTS[variant]
    monkeypatch.setattr(K["moe"], "W13_CONFIG", w13)
    monkeypatch.setattr(K["moe"], "W2_CONFIG", w2)
    compare("moe", *to_device(moe_case(gen(114), batch=1), device))
    compare("moe_hash", *to_device(moe_hash_case(gen(115), batch=1), device))


@pytest.mark.parametrize("device", DEVICES)
def test_moe_clamps_large_activations(device):
    inputs, attrs = moe_case(gen(105), batch=1)
    inputs[0] = (inputs[0].double() * 40).to(torch.bfloat16)  # |w1 x| well past the limit
    compare("moe", [t.to(device) for t in inputs], attrs)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_hash(device):
    compare("moe_hash", *to_device(moe_hash_case(gen(106), batch=2), device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grouped", [True, False])
def test_moe_batched_rows_sharing_experts(device, grouped, monkeypatch):
    """Batch 8 over 16 experts, top-2: most experts are chosen by several rows. Expert-major
    (each expert read once for all its rows) and slot-major must both match the torch op."""
    monkeypatch.setattr(K["moe"], "GROUPED_MIN_BATCH", 2 if grouped else K["moe"].MAX_BATCH + 1)
    inputs, attrs = moe_case(gen(116), batch=8)
    scores = torch.nn.functional.softplus(inputs[0].float() @ inputs[1].float().T).sqrt() + inputs[2]
    chosen = torch.topk(scores, 2).indices
    assert chosen.unique().numel() < chosen.numel()  # the case really shares experts
    compare("moe", *to_device((inputs, attrs), device))
    hashed, hattrs = moe_hash_case(gen(117), batch=8)
    hashed[2][hashed[1][0]] = torch.tensor([5, 5], dtype=torch.int32)  # a row listing one expert twice
    hashed[2][hashed[1][1]] = torch.tensor([5, 9], dtype=torch.int32)  # another row sharing expert 5
    compare("moe_hash", *to_device((hashed, hattrs), device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hc_mult", [4, 3])  # 4: the scalar Sinkhorn (V4-Flash); else the tensor form
@pytest.mark.parametrize("mix_rows", [1, 2])  # 2: batch 3 leaves a short last row tile
def test_hc_pre(device, hc_mult, mix_rows, monkeypatch):
    monkeypatch.setattr(K["mhc"], "MIX_ROWS", mix_rows)
    fused, _, _ = compare("hc_pre", *to_device(hc_pre_case(gen(107), hc_mult=hc_mult), device))
    comb = fused[2].double()
    assert (comb.sum(1) - 1).abs().max() < 1e-3  # columns normalised last


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hc_mult", [4, 3])
def test_hc_pre_norm_is_hc_pre_then_the_norm(device, hc_mult, monkeypatch):
    """The finish that norms its row (mhc, note "norm in the finish") against the torch op, and
    against hc_pre's kernels followed by the norm launch: the same bits under the interpreter; on
    the GPU its sums run on other warps (a rounding of y apart at most). Past NORM_MAX_D those two
    launches run: the same bits."""
    inputs, attrs = to_device(hc_pre_norm_case(gen(110), hc_mult=hc_mult), device)
    fused, _, _ = compare("hc_pre_norm", inputs, attrs)
    apart, _ = _run("hc_pre", FUSED["hc_pre"], inputs[:4], attrs)
    normed = torch.full_like(apart[0], float("nan"))
    FUSED["rms_norm"]([apart[0], inputs[4]], [normed], {"eps": attrs["norm_eps"]}, None)
    if device == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(fused, [normed, *apart[1:]]))
    else:
        torch.testing.assert_close(fused[0].float(), normed.float(), rtol=8e-3, atol=1e-3)
        for a, b in zip(fused[1:], apart[1:]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(K["mhc"], "NORM_MAX_D", 128)  # below the small config's 256: the two launches
    two, _ = _run("hc_pre_norm", FUSED["hc_pre_norm"], inputs, attrs)
    assert all(torch.equal(a, b) for a, b in zip(two, [normed, *apart[1:]]))


@pytest.mark.parametrize("device", DEVICES)
def test_hc_head(device):
    compare("hc_head", *to_device(hc_head_case(gen(108)), device))


@pytest.mark.parametrize("device", DEVICES)
def test_hc_post_and_in_place(device):
    inputs, attrs = to_device(hc_post_case(gen(109)), device)
    fused, _, _ = compare("hc_post", inputs, attrs)
    X = inputs[1].clone()
    FUSED["hc_post"]([inputs[0], X, inputs[2], inputs[3]], [X], attrs, None)  # out aliases X
    assert torch.equal(X, fused[0])


@pytest.fixture(params=["fma", "dot"])
def attn_impl(request, monkeypatch):
    """Both attention cores: per (row, head) FMA, and 16 heads a program on tensor cores."""
    monkeypatch.setattr(K["attention"], "ATTN_IMPL", request.param)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("positions", [None, [0, 15, 16], [63, 1, 47]])
def test_swa_attention(device, positions, attn_impl):
    compare("swa_attention", *to_device(attention_case(gen(110), positions=positions), device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("parts", [2, 4])
def test_swa_attention_split_window(device, parts, monkeypatch):
    """The dot core's window cut over programs ("split window"): 64 keys in steps of 16. At
    position 5 only the last part has keys (the others hold the sink or nothing: a part with no
    key must weigh 0, not NaN); the merge must take every part (one part alone fails the check)."""
    A = K["attention"]
    monkeypatch.setattr(A, "ATTN_IMPL", "dot")
    monkeypatch.setattr(A, "DOT_BLOCK_W", 16)
    monkeypatch.setattr(A, "ATTN_MIN_PROGRAMS", 3 * parts)  # batch 3, one head block: `parts` parts
    assert A.window_parts(3, 4, 64) == parts
    inputs, attrs = attention_case(gen(118), positions=[5, 63, 50], kv_start=[0, 0, 20], window=64)
    split, _, _ = compare("swa_attention", *to_device((inputs, attrs), device))
    monkeypatch.setattr(A, "ATTN_MIN_PROGRAMS", 1)
    assert A.window_parts(3, 4, 64) == 1
    whole, _, _ = compare("swa_attention", *to_device((inputs, attrs), device))
    assert rel_err(split[0].float(), whole[0].float()) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_swa_attention_batch_one_fma_projections(device, monkeypatch):
    fma = GEMV(16, 128, 4, 3, False)
    for knob in ("PROJ_CONFIG", "Q_CONFIG", "WO_A_CONFIG", "WO_B_CONFIG"):
        monkeypatch.setattr(K["attention"], knob, fma)
    compare("swa_attention", *to_device(attention_case(gen(116), batch=1), device))


@pytest.mark.parametrize("device", DEVICES)
def test_swa_attention_padded_rows_and_kv_start(device, attn_impl):
    inputs, attrs = attention_case(gen(111), positions=[40, 33, 20], kv_start=[0, 30, 0])
    inputs[12][0] = -1  # row 0 padded: writes nothing, attends nothing
    before = inputs[9].clone()
    fused, after, _ = compare("swa_attention", [t.to(device) for t in inputs], attrs)
    assert torch.equal(fused[0][0].cpu(), torch.zeros_like(fused[0][0].cpu()))
    changed = (after[9].cpu() != before).any(-1).nonzero().flatten().tolist()
    assert len(changed) == 2, changed  # rows 1 and 2 wrote one slot each


@pytest.mark.parametrize("device", DEVICES)
def test_swa_attention_fp8_rounded_kv(device, attn_impl):
    compare("swa_attention", *to_device(attention_case(gen(112), kv_fp8_round=True), device))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_and_rms_norm(device):
    g = gen(113)
    x = (torch.randn(3, 256, generator=g) + 0.1).bfloat16().to(device)
    w = (torch.randn(96, 256, generator=g) / 16).bfloat16().to(device)
    compare("linear", [x, w], {})
    nw = (1 + 0.1 * torch.randn(256, generator=g)).bfloat16().to(device)
    compare("rms_norm", [x.view(3, 1, 256).expand(3, 2, 256).contiguous(), nw], {"eps": 1e-6})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("streams", [True, False])
def test_combiner(device, streams):
    compare("combiner", *to_device(combiner_case(gen(117), streams=streams), device))


# ---- the V4-Flash shapes, on the GPU ----------------------------------------------------------

FLASH = V4Config.flash()


def _randn(*shape, scale=1.0, dtype=torch.bfloat16, device="cuda"):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


@cuda
@needs_cuda
def test_flash_lm_head_and_argmax():
    d, v = FLASH.hidden_size, FLASH.vocab_size
    h = _randn(2, d, scale=3.0)
    inputs = [
        h,
        (1 + _randn(d, scale=0.1, dtype=torch.float32)).bfloat16(),
        _randn(v, d, scale=1 / math.sqrt(d)),
    ]
    attrs = {"eps": FLASH.rms_norm_eps, "vocab_rows": 0}
    logits = compare("lm_head", inputs, attrs)[0][0]
    limit = torch.tensor([v], dtype=torch.int32, device="cuda")
    fused, _ = _run("draft_argmax", FUSED["draft_argmax"], [logits, limit], {})
    ref, _ = _run("draft_argmax", get_op("draft_argmax").impl, [logits, limit], {})
    assert torch.equal(fused[0], ref[0])
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=1e-7)


@pytest.fixture
def flash_experts():
    """The V4-Flash routed experts (256 x [2048, 4096], bf16: 13 GB) and the shared expert, made
    for each test (~0.1 s on a GPU) inside the gpu_heavy lock (conftest.py) and dropped after it:
    module-scoped, they outlived the lock and sat beside another worker's heavy test."""
    d, e, i = FLASH.hidden_size, FLASH.n_routed_experts, FLASH.moe_intermediate_size
    torch.manual_seed(7)
    weights = [
        _randn(e, i, d, scale=1 / math.sqrt(d)),
        _randn(e, d, i, scale=1 / math.sqrt(i)),
        _randn(e, i, d, scale=1 / math.sqrt(d)),
        _randn(i, d, scale=1 / math.sqrt(d)),
        _randn(d, i, scale=1 / math.sqrt(i)),
        _randn(i, d, scale=1 / math.sqrt(d)),
    ]
    yield weights
    weights.clear()  # pytest keeps the fixture's value until after this teardown: drop the tensors now


def _flash_moe_attrs():
    return {"routed_scaling_factor": FLASH.routed_scaling_factor, "swiglu_limit": FLASH.swiglu_limit}


@pytest.mark.gpu_heavy
@cuda
@needs_cuda
@pytest.mark.parametrize("batch", [1, 8, 32])  # 1: slot-major; 8 and 32: expert-major, shared experts
def test_flash_moe(flash_experts, batch):
    d, e = FLASH.hidden_size, FLASH.n_routed_experts
    x, gate_w = _randn(batch, d), _randn(e, d, scale=1 / math.sqrt(d))
    bias = _randn(e, scale=0.1, dtype=torch.float32)
    attrs = {"top_k": FLASH.num_experts_per_tok, **_flash_moe_attrs()}
    compare("moe", [x, gate_w, bias, *flash_experts], attrs)


@pytest.mark.gpu_heavy
@cuda
@needs_cuda
@pytest.mark.parametrize("batch", [1, 8])
def test_flash_moe_hash(flash_experts, batch):
    d, e, k, v = FLASH.hidden_size, FLASH.n_routed_experts, FLASH.num_experts_per_tok, FLASH.vocab_size
    tid2eid = torch.rand(v, e, device="cuda").argsort(-1)[:, :k].to(torch.int32)  # k distinct experts per token
    token = torch.randperm(v, device="cuda")[:batch]
    if batch > 1:
        tid2eid[token[1]] = tid2eid[token[0]]  # two rows with the same experts
        tid2eid[token[2], :2] = tid2eid[token[0], 0]  # a row listing one expert twice
    inputs = [_randn(batch, d), token, tid2eid, _randn(e, d, scale=1 / math.sqrt(d)), *flash_experts]
    compare("moe_hash", inputs, _flash_moe_attrs())


@cuda
@needs_cuda
def test_flash_hc_head():
    c, d = FLASH.hc_mult, FLASH.hidden_size
    inputs = [
        _randn(2, c, d),
        _randn(c, c * d, scale=1 / math.sqrt(c * d), dtype=torch.float32),
        _randn(c, scale=0.5, dtype=torch.float32),
        (0.5 + torch.rand(1, device="cuda")).float(),
    ]
    compare("hc_head", inputs, {"eps": FLASH.rms_norm_eps, "hc_eps": FLASH.hc_eps})


@cuda
@needs_cuda
def test_flash_hc_pre_and_post():
    c, d = FLASH.hc_mult, FLASH.hidden_size
    X = _randn(2, c, d)
    fn = _randn(FLASH.hc_mix_dim, c * d, scale=1 / math.sqrt(c * d), dtype=torch.float32)
    inputs = [
        X,
        fn,
        _randn(FLASH.hc_mix_dim, scale=0.5, dtype=torch.float32),
        (0.5 + torch.rand(3, device="cuda")).float(),
    ]
    attrs = {"eps": FLASH.rms_norm_eps, "hc_eps": FLASH.hc_eps, "iters": FLASH.hc_sinkhorn_iters}
    y, post, comb = compare("hc_pre", inputs, attrs)[0]
    compare("hc_post", [y, X, post, comb], {})


@cuda
@needs_cuda
def test_flash_swa_attention(attn_impl):
    cfg = FLASH
    h, d, dim, ql, g, ol = (
        cfg.num_attention_heads,
        cfg.head_dim,
        cfg.hidden_size,
        cfg.q_lora_rank,
        cfg.o_groups,
        cfg.o_lora_rank,
    )
    b, blocks = 2, 16
    table = torch.randperm(b * blocks + 3, device="cuda")[: b * blocks].view(b, blocks).to(torch.int32)
    inputs = [
        _randn(b, dim),
        _randn(ql, dim, scale=1 / math.sqrt(dim)),
        (1 + _randn(ql, scale=0.1, dtype=torch.float32)).bfloat16(),
        _randn(h * d, ql, scale=1 / math.sqrt(ql)),
        _randn(d, dim, scale=1 / math.sqrt(dim)),
        (1 + _randn(d, scale=0.1, dtype=torch.float32)).bfloat16(),
        _randn(g * ol, h * d // g, scale=1 / math.sqrt(h * d // g)),
        _randn(dim, g * ol, scale=1 / math.sqrt(g * ol)),
        _randn(h, dtype=torch.float32),
        _randn((b * blocks + 3) * 16, d),
        torch.tensor([200, 77], dtype=torch.int64, device="cuda"),
        torch.zeros(b, dtype=torch.int32, device="cuda"),
        table,
    ]
    attrs = attention_attrs(cfg, CacheGeometry(num_slots=(b * blocks + 3) * 16, max_blocks_per_seq=blocks))
    compare("swa_attention", inputs, attrs)


def test_fused_chain_at_batch_3_never_falls_back_to_a_torch_op(monkeypatch):
    """The proposer's metadata are strided views of one packed buffer; every fused op takes them.

    (Before: at B > 1 the fused attention saw non-contiguous positions and ran the torch op,
    172 kernel nodes per step instead of 32 on the H200.)
    """
    import draftgraph.ops.attention
    import draftgraph.ops.basic
    import draftgraph.ops.combiner
    import draftgraph.ops.lm_head
    import draftgraph.ops.mhc
    import draftgraph.ops.moe
    import draftgraph.ops.sampling
    from draftgraph.runtime.ir.op_registry import get_op
    from proposer_fixtures import SMALL, hidden, make_proposer

    # the fused impls are the (interpreted or compiled) kernel modules' own
    fused = {"lm_head": K["head"].lm_head_impl, "draft_argmax": K["head"].draft_argmax_impl,
             "moe": K["moe"].moe_impl, "moe_hash": K["moe"].moe_hash_impl, "hc_pre": K["mhc"].hc_pre_impl,
             "hc_pre_norm": K["mhc"].hc_pre_norm_impl, "hc_head": K["mhc"].hc_head_impl,
             "hc_post": K["mhc"].hc_post_impl,
             "swa_attention": K["attention"].swa_attention_impl, "linear": K["gemv"].linear_impl,
             "rms_norm": K["gemv"].rms_norm_impl, "combiner": K["combiner"].combiner_impl,
             "embed_combiner": K["combiner"].embed_combiner_impl}
    fallbacks = []
    for module, name in [(draftgraph.ops.moe, "_moe_impl"), (draftgraph.ops.moe, "_moe_hash_impl"),
                         (draftgraph.ops.mhc, "_hc_pre_impl"), (draftgraph.ops.mhc, "_hc_pre_norm_impl"),
                         (draftgraph.ops.mhc, "_hc_head_impl"),
                         (draftgraph.ops.mhc, "_hc_post_impl"), (draftgraph.ops.attention, "_attn_impl"),
                         (draftgraph.ops.lm_head, "_lm_head_impl"), (draftgraph.ops.sampling, "_draft_argmax_impl"),
                         (draftgraph.ops.basic, "_linear_impl"), (draftgraph.ops.basic, "_rms_norm_impl"),
                         (draftgraph.ops.combiner, "_combiner_impl"),
                         (draftgraph.ops.combiner, "_embed_combiner_impl")]:
        monkeypatch.setattr(module, name, lambda *a, name=name: fallbacks.append(name))
    device = "cuda" if HAS_CUDA else "cpu"
    prop = make_proposer(kernels="torch", buckets=(3,), device=device)
    executor = prop._executor(3, 2, False)
    for step in executor.steps:
        if get_op(step.node.op).name in fused:
            step.impl = fused[step.node.op]
    g = torch.Generator().manual_seed(0)
    states = [prop.alloc_state() for _ in range(3)]
    prop.propose_batch([1, 2, 3], [hidden(SMALL, g).to(device) for _ in range(3)], [30, 45, 7], 2, states)
    assert fallbacks == []
