"""The fused ops on native (FP8 / MXFP4) weights, wired (issue 28.2): attention, combiner, linear, moe, moe_hash.

Each op runs at the small config with its block-scaled weights as QuantWeights three ways: the
fused impl (``fp8_gemv`` / ``moe_mxfp4`` inside), the torch op on the same QuantWeights, and
the fused impl on the dequantised bf16 weights (the bf16 kernels). Outputs are poisoned with
NaN. The reference is the torch op on fp32 activations with the same QuantWeights (it
dequantises to fp32, and rounds the W8A8 activations the same way), as in
test_triton_kernels.compare. W8A8 (``activations="fp8"``) on and off: on, the fused result
must follow the torch op's rounding, not the plain bf16 result. Without CUDA the kernels run
under Triton's CPU interpreter; nothing here has run on a GPU.
"""

from __future__ import annotations

import sys

import pytest
import torch

# Before anything imports triton: without CUDA it sets the interpreter up (tests/triton_modules.py).
from triton_modules import counting_carves, load_kernel_modules

K = load_kernel_modules(
    ["_common", "fp8_round", "gemv", "moe_grouped", "fp8_linear", "combiner", "moe_mxfp4", "moe", "attention"]
)

from draftgraph.runtime.execution.kernel_choice import block_scaled_gap, select_impl  # noqa: E402
from draftgraph.runtime.ir.op_registry import get_op, register_fused  # noqa: E402
from draftgraph.runtime.ir.tensor_spec import TensorSpec  # noqa: E402
from draftgraph.runtime.model.quant import QuantWeight, quantize_weight  # noqa: E402
from v4_op_cases import attention_case, combiner_case, gen, moe_case, moe_hash_case, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = {
    "linear": K["gemv"].linear_impl,
    "combiner": K["combiner"].combiner_impl,
    "embed_combiner": K["combiner"].embed_combiner_impl,  # the combiner after fold_embed_into_combiner
    "swa_attention": K["attention"].swa_attention_impl,
    "moe": K["moe"].moe_impl,
    "moe_hash": K["moe"].moe_hash_impl,
}
# Which inputs are block-scaled in the real checkpoint (runtime/model/weight_names.linear_kind).
NATIVE = {
    "linear": {1: "fp8"},
    "combiner": {4: "fp8", 5: "fp8"},
    "swa_attention": {1: "fp8", 3: "fp8", 4: "fp8", 6: "fp8", 7: "fp8"},
    "moe": {3: "mxfp4", 4: "mxfp4", 5: "mxfp4", 6: "fp8", 7: "fp8", 8: "fp8"},
    "moe_hash": {4: "mxfp4", 5: "mxfp4", 6: "mxfp4", 7: "fp8", 8: "fp8", 9: "fp8"},
}
MUTATED = {"swa_attention": (9,)}  # the KV cache
W8A8 = {"activations": "fp8"}


def linear_case(g, batch=3):
    x = (torch.randn(batch, 2, 256, generator=g, dtype=torch.float64) + 0.1).bfloat16()  # [B, 2, D]: rows flatten
    w = (torch.randn(320, 256, generator=g, dtype=torch.float64) / 16).bfloat16()
    return [x, w], {}


CASES = {
    "linear": linear_case,
    "combiner": combiner_case,
    "swa_attention": attention_case,
    "moe": moe_case,
    "moe_hash": moe_hash_case,
}


def native(name, inputs):
    """The case's weights quantised as the checkpoint stores them, each block scaled by its own power of two."""
    out = list(inputs)
    for i, fmt in NATIVE[name].items():
        w = inputs[i].float()
        # Spread the blocks over 2^-3..2^3 (rows for MXFP4, 128-row blocks for FP8): a scale read
        # from the wrong block shows as an O(1) error, not as rounding.
        rows = w.shape[-2]
        step = 1 if fmt == "mxfp4" else 128
        factor = torch.exp2(torch.arange(-(-rows // step)).remainder(7).float() - 3).repeat_interleave(step)[:rows]
        out[i] = quantize_weight(w * factor[:, None], fmt)
    return out


def dequantised(inputs):
    return [t.dequantize() if isinstance(t, QuantWeight) else t for t in inputs]


def run(name, impl, inputs, attrs, upcast_to=None):
    """impl on poisoned outputs; ``upcast_to``: the bf16 inputs and outputs in that dtype (the
    shape rule, which wants bf16 activations beside a block-scaled weight, sees the bf16 ones)."""
    written = MUTATED.get(name, ())
    specs = get_op(name).infer([TensorSpec.of(t) for t in inputs], attrs)
    inputs = [t.clone() if i in written else t for i, t in enumerate(inputs)]
    if upcast_to is not None:
        inputs = [upcast(t, upcast_to) for t in inputs]
    dtypes = [upcast_to if upcast_to is not None and s.dtype == torch.bfloat16 else s.dtype for s in specs]
    outs = [torch.full(s.shape, float("nan"), dtype=dt, device=DEVICE) for s, dt in zip(specs, dtypes)]
    assert impl(inputs, outs, attrs, None) is None
    assert not torch.isnan(outs[0]).any(), f"{name}: unwritten (NaN) output elements"
    return outs[0], inputs


def upcast(t, dtype):
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t


def to_device(inputs):
    return [t.to(DEVICE) for t in inputs]


def three_ways(name, inputs, attrs, slack=2.0, floor=2e-3, limit=1.5e-2, with_bf16=True):
    """fused on the QuantWeights, the torch op on them, fused on the dequantised weights; checked against fp32.

    The fused error against the fp32 run must be about the bf16 torch op's and under ``limit``.
    """
    torch_op = get_op(name).impl
    fused, fused_in = run(name, FUSED[name], inputs, attrs)
    ref_torch, torch_in = run(name, torch_op, inputs, attrs)
    ref, ref_in = run(name, torch_op, inputs, attrs, upcast_to=torch.float32)
    e_f, e_t = rel_err(fused, ref), rel_err(ref_torch, ref)
    assert e_f <= max(slack * e_t, floor) and e_f < limit, f"{name}: fused {e_f:.2e}, torch {e_t:.2e} vs fp32"
    for i in MUTATED.get(name, ()):
        e_f, e_t = rel_err(fused_in[i], ref_in[i]), rel_err(torch_in[i], ref_in[i])
        assert e_f <= max(slack * e_t, floor), f"{name} state {i}: fused {e_f:.2e}, torch {e_t:.2e}"
    bf16_fused = run(name, FUSED[name], dequantised(inputs), attrs)[0] if with_bf16 else None
    return fused, ref_torch, bf16_fused


def uses(monkeypatch, module, name) -> list:
    """Count the calls of ``module.name`` (the kernel entry points the fused impls reach)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name if not kwargs.get("split_k", 1) > 1 else f"{name} split {kwargs['split_k']}"
                     + (" reduced" if kwargs.get("split_reduce") is not None else ""))  # fmt: skip
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def no_torch_fallback(monkeypatch):
    import draftgraph.ops.attention
    import draftgraph.ops.basic
    import draftgraph.ops.combiner
    import draftgraph.ops.moe

    fallbacks = []
    for module, fn in [
        (draftgraph.ops.basic, "_linear_impl"),
        (draftgraph.ops.combiner, "_combiner_impl"),
        (draftgraph.ops.attention, "_attn_impl"),
        (draftgraph.ops.moe, "_moe_impl"),
        (draftgraph.ops.moe, "_moe_hash_impl"),
    ]:
        monkeypatch.setattr(module, fn, lambda *a, fn=fn: fallbacks.append(fn))
    return fallbacks


# ---- each op, W8A8 off and on -------------------------------------------------------------------

BATCHES = {"linear": [1, 3], "combiner": [1, 3], "swa_attention": [1, 3], "moe": [1, 3], "moe_hash": [1, 3]}
PARAMS = [(name, b) for name, bs in BATCHES.items() for b in bs]


@pytest.mark.parametrize("name,batch", PARAMS)
def test_fused_on_native_weights_matches_the_torch_op_and_the_bf16_kernels(name, batch, monkeypatch):
    inputs, attrs = CASES[name](gen(300 + batch), batch=batch)
    inputs = to_device(native(name, inputs))
    fp8_calls = uses(monkeypatch, K["fp8_linear"], "fp8_gemv")
    mx_calls = uses(monkeypatch, K["moe_mxfp4"], "moe_mxfp4_launches")
    fused, ref_torch, bf16_fused = three_ways(name, inputs, attrs)
    # The native kernels ran (not the bf16 ones on a dequantised copy, not the torch op).
    if name.startswith("moe"):
        assert mx_calls == ["moe_mxfp4_launches"], mx_calls
    else:
        assert fp8_calls and not mx_calls, (fp8_calls, mx_calls)
    if name == "combiner":  # both halves in one GEMV over both Ks ("two launches")
        assert fp8_calls == [f"fp8_gemv split {K['combiner'].COMBINER_SPLIT} reduced"], fp8_calls
    if name == "swa_attention":  # wq_a + wkv split ("split proj"); wo_a and wo_b at B > 1 ("split wo")
        A = K["attention"]
        wo = [f"fp8_gemv split {A.WO_SPLIT} reduced"] * 2 if batch > 1 else ["fp8_gemv"] * 2
        assert fp8_calls == [f"fp8_gemv split {A.PROJ_SPLIT}", "fp8_gemv", *wo], fp8_calls
    # Bf16 activations: the same products as the bf16 kernels on the dequantised weights (exact
    # dequantisation), summed in another order (K tiles of 128). The attention rounds raw qa and kv
    # to bf16 as the reference does (fp8_gemv reads bf16), where its bf16 kernels keep them fp32.
    limit = 1e-2 if name == "swa_attention" else 4e-3
    assert rel_err(fused, bf16_fused) < limit, f"{name}: native {rel_err(fused, bf16_fused):.2e} from bf16 fused"
    assert rel_err(fused, ref_torch) < 1e-2


# The activations each fused op rounds through FP8 under W8A8 by a launch of fp8_round_rows, as
# [rows, cols] of the runs of 128. Not by a launch: the combiner's halves (its norms write them
# rounded) and the attention's q_norm(qa) (kv finish writes it rounded; from 8 rows wq_b's kernel
# rounds it on the FP8 tensor cores, which the interpreter has not, so fp8_gemv rounds it first).
def _w8a8_rounded(name, batch, attrs):
    from v4_op_cases import CFG

    d, inter, k = CFG.hidden_size, CFG.moe_intermediate_size, CFG.num_experts_per_tok
    g, hd = CFG.o_groups, CFG.num_attention_heads * CFG.head_dim
    q_on_cores = [(batch, CFG.q_lora_rank)] if batch >= K["attention"].Q_W8A8_CORE_MIN_ROWS else []
    return {
        "linear": [(batch * 2, 256)],
        "combiner": [],
        "swa_attention": [(batch, d), *q_on_cores, (batch * g, hd // g), (batch, g * CFG.o_lora_rank)],
        "moe": [(batch, d), (batch * k + batch, inter)],
        "moe_hash": [(batch, d), (batch * k + batch, inter)],
    }[name]


@pytest.mark.parametrize(
    "name,batch,apart",
    [("linear", 3, 3), ("combiner", 1, 3), ("swa_attention", 3, 1.5), ("swa_attention", 8, 1.5), ("moe", 3, 3),
     ("moe_hash", 1, 3)],  # fmt: skip
)
def test_w8a8_on_native_weights_follows_the_torch_ops_rounding(name, batch, apart, monkeypatch):
    inputs, attrs = CASES[name](gen(320 + batch), batch=batch)
    inputs = to_device(native(name, inputs))
    # Against fp32 the FP8 roundings of intermediates flip where bf16 and fp32 differ (attention:
    # ~4e-2 for the torch op and the fused impl alike), so the fp32 run bounds them only loosely;
    # the bf16 torch op, rounding the same values, is the reference.
    fused, ref_torch, _ = three_ways(name, inputs, {**attrs, **W8A8}, limit=6e-2, with_bf16=False)
    plain, _ = run(name, FUSED[name], inputs, attrs)
    # W8A8 moves the result by the FP8 rounding of the activations (~2^-5 an element); the fused
    # result stays nearer the torch op's W8A8 result. Nearer by less in the attention: its four
    # roundings in a row each flip an FP8 step wherever fused and torch differ by a bf16 ulp
    # near a tie (qa's norm, o's softmax), so the two drift ~2e-2 apart.
    moved, kept = rel_err(plain, ref_torch), rel_err(fused, ref_torch)
    assert moved > apart * kept, f"{name}: W8A8 moved {moved:.2e}, fused vs torch W8A8 {kept:.2e}"
    # And the fused path rounds the activations the torch op rounds (x once for wq_a and wkv), each
    # by one fp8_round_rows launch (ops/triton/fp8_round.py), never by the torch rounding.
    seen = []
    real = K["fp8_round"].fp8_round_rows

    def spy(t, *args, **kw):
        seen.append((t.numel() // t.shape[-1], t.shape[-1]))
        return real(t, *args, **kw)

    def torch_rounding(*args, **kw):
        raise AssertionError("a fused impl rounded with the torch ops")

    for module in ("fp8_round", "fp8_linear", "attention", "moe"):
        monkeypatch.setattr(K[module], "fp8_round_rows", spy)
    monkeypatch.setattr(_quantised(), "fp8_round_activations", torch_rounding)
    run(name, FUSED[name], inputs, {**attrs, **W8A8})
    assert sorted(seen) == sorted(_w8a8_rounded(name, batch, attrs)), seen


def _quantised():
    import draftgraph.ops.quantised

    return draftgraph.ops.quantised  # act_in: the torch ops' rounding, which no fused impl may call


@pytest.mark.parametrize("max_rows", [16, 4])  # 8 stream rows: one GEMV over both Ks, or past the limit a GEMV a half
def test_combiner_streams_mode_on_native_weights(monkeypatch, max_rows):
    monkeypatch.setattr(K["combiner"], "COMBINER_MAX_ROWS", max_rows)
    inputs, attrs = combiner_case(gen(340), batch=2, streams=True)
    fallbacks = no_torch_fallback(monkeypatch)
    fp8_calls = uses(monkeypatch, K["fp8_linear"], "fp8_gemv")
    three_ways("combiner", to_device(native("combiner", inputs)), attrs)
    assert fallbacks == []
    assert len(fp8_calls) == (1 if max_rows == 16 else 2), fp8_calls


def test_combiner_with_one_fp8_projection():
    inputs, attrs = combiner_case(gen(341), batch=2, streams=False)
    inputs = to_device(native("combiner", inputs))
    inputs[5] = inputs[5].dequantize()  # h_proj bf16, e_proj FP8
    three_ways("combiner", inputs, attrs)


@pytest.mark.parametrize(
    "streams,max_rows,fmt,w8a8",
    [(True, 16, "fp8", False), (True, 16, "fp8", True), (True, 4, "fp8", False), (False, 16, "fp8", False),
     (False, 16, "one fp8", False), (True, 16, "bf16", False)],  # fmt: skip
    ids=["two launches", "two launches w8a8", "a GEMV a half", "collapsed", "one fp8", "bf16"],
)
def test_embed_combiner_reads_the_table_rows_the_combiner_would_read(streams, max_rows, fmt, w8a8, monkeypatch):
    """The fold_embed_into_combiner op: its kernels read e's rows from the table at the tokens
    (note "rows from the table"), so the output is bit for bit the fused combiner's on the gathered
    rows, in every path the combiner takes; and its torch op is the combiner's on them."""
    monkeypatch.setattr(K["combiner"], "COMBINER_MAX_ROWS", max_rows)
    inputs, attrs = combiner_case(gen(343), batch=3, streams=streams)
    attrs = {**attrs, **W8A8} if w8a8 else attrs
    if fmt != "bf16":
        inputs = native("combiner", inputs)
    if fmt == "one fp8":
        inputs[5] = inputs[5].dequantize()
    table = torch.randn(50, inputs[0].shape[1], generator=gen(344), dtype=torch.float64).bfloat16()
    token = torch.tensor([7, 49, 7], dtype=torch.int64)
    inputs, table, token = to_device(inputs), table.to(DEVICE), token.to(DEVICE)
    gathered = [table.index_select(0, token), *inputs[1:]]
    folded = [token, table, *inputs[1:]]
    fallbacks = no_torch_fallback(monkeypatch)
    want, _ = run("combiner", K["combiner"].combiner_impl, gathered, attrs)
    got, _ = run("embed_combiner", K["combiner"].embed_combiner_impl, folded, attrs)
    assert fallbacks == [] and torch.equal(got, want)
    monkeypatch.undo()
    assert torch.equal(run("embed_combiner", get_op("embed_combiner").impl, folded, attrs)[0],
                       run("combiner", get_op("combiner").impl, gathered, attrs)[0])


def test_moe_rows_sharing_experts_on_native_weights():
    """Batch 8 over 16 experts, expert-major: each MXFP4 expert read once for all the rows that chose it."""
    hashed, attrs = moe_hash_case(gen(342), batch=8)
    hashed[2][hashed[1][0]] = torch.tensor([5, 5], dtype=torch.int32)  # a row listing one expert twice
    hashed[2][hashed[1][1]] = torch.tensor([5, 9], dtype=torch.int32)
    three_ways("moe_hash", to_device(native("moe_hash", hashed)), attrs, with_bf16=False)


# ---- the workspace rule is the scratch the MXFP4 MoE carves --------------------------------------


@pytest.mark.parametrize("batch,w8a8", [(1, False), (3, True)])
def test_moe_workspace_rule_covers_the_mxfp4_scratch(batch, w8a8, monkeypatch):
    """Given a workspace of exactly the rule's bytes (poisoned: 0xFF is NaN in bf16 and fp32), every
    carve of the call fits in it and nothing is allocated; the result is the unpoisoned one."""
    inputs, attrs = moe_case(gen(350 + batch), batch=batch)
    attrs = {**attrs, **W8A8} if w8a8 else attrs
    inputs = to_device(native("moe", inputs))
    specs = [TensorSpec.of(t) for t in inputs]
    nbytes = K["moe"].moe_workspace(specs, attrs, batch)
    carved = counting_carves(K, monkeypatch)
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=DEVICE)
    out = torch.full((batch, inputs[0].shape[1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    K["moe"].moe_impl(inputs, [out], attrs, ws)
    # The route's scratch, then moe_mxfp4's (W8A8 carves its act rows again): the rule is tight.
    assert len(carved) == 2 + w8a8 and carved[0] + carved[1] == nbytes, (carved, nbytes)
    want, _ = run("moe", FUSED["moe"], inputs, attrs)
    assert torch.equal(out, want)


@pytest.mark.parametrize("name,batch", [("swa_attention", 1), ("swa_attention", 3), ("combiner", 1), ("combiner", 3)])
def test_split_launches_count_on_poisoned_scratch(name, batch, monkeypatch):
    """The attention's and the combiner's split launches on a workspace of exactly their rule's bytes,
    poisoned (0xFF: NaN floats, counts of -1): every carve fits, the op zeroes its own arrival counts
    before they are used, and the result is the one on fresh scratch, bit for bit."""
    if name == "swa_attention":
        monkeypatch.setattr(K["attention"], "ATTN_IMPL", "dot")
        monkeypatch.setattr(K["attention"], "DOT_BLOCK_W", 16)  # the small window in parts ("split window")
    case = CASES[name](gen(360 + batch), batch=batch, **({"window": 64} if name == "swa_attention" else {}))
    inputs, attrs = to_device(native(name, case[0])), case[1]
    rule = {"swa_attention": K["attention"].attention_workspace, "combiner": K["combiner"].combiner_workspace}[name]
    nbytes = rule([TensorSpec.of(t) for t in inputs], attrs, batch)
    want, _ = run(name, FUSED[name], inputs, attrs)
    carved = counting_carves(K, monkeypatch, modules=("attention", "combiner"))
    for _ in range(2):  # twice on the same scratch: the counts are zeroed (and reset) each call
        ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=DEVICE)
        written = [t.clone() if i in MUTATED.get(name, ()) else t for i, t in enumerate(inputs)]
        out = torch.full_like(want, float("nan"))
        FUSED[name](written, [out], attrs, ws)
        assert torch.equal(out, want), name
    assert carved == [nbytes, nbytes], (carved, nbytes)  # the rule is tight


def test_config_for_takes_wide_tiles_where_the_grid_stays_full():
    """Past 16 rows, 64-row tiles where the launch keeps WIDE_GRID_PROGRAMS programs on them (the
    V4-Flash shapes at B=32 as the chain launches them), else the 32-row ones."""
    F = K["fp8_linear"]
    assert F.config_for(1, 4096) is F.BATCH1_CONFIG and F.config_for(16, 32768) is F.DEFAULT
    assert F.config_for(32, 32768) is F.WIDE_GRID_CONFIG  # wq_b: 512 programs
    assert F.config_for(32, 4096, 4) is F.WIDE_GRID_CONFIG  # wo_b in 4 K parts: 256
    assert F.config_for(128, 4096) is F.WIDE_GRID_CONFIG  # h_proj on B=32's stream rows: 64 x 2 batch blocks
    assert F.config_for(32, 4096) is F.LARGE_BATCH_CONFIG  # e_proj: 64
    assert F.config_for(32, 1536, 4) is F.LARGE_BATCH_CONFIG  # wq_a + wkv: 96
    assert F.config_for(32) is F.LARGE_BATCH_CONFIG  # outputs not given


def test_wide_grid_tiles_in_the_attention_past_16_rows(monkeypatch):
    """The attention's GEMVs on WIDE_GRID_CONFIG, forced on every launch past 16 rows
    (WIDE_GRID_PROGRAMS 1: the small config's grids are short): the split's arrival counts, sized by
    the same rule (attention._wo_split), fit the op's scratch poisoned; the result matches the torch
    op and the bf16 kernels, and is the same on poisoned scratch, bit for bit."""
    F = K["fp8_linear"]
    monkeypatch.setattr(F, "WIDE_GRID_PROGRAMS", 1)
    configs = []
    real = F.fp8_gemv
    monkeypatch.setattr(F, "fp8_gemv", lambda *a, **kw: configs.append(kw["config"]) or real(*a, **kw))
    batch = 17
    case = CASES["swa_attention"](gen(380), batch=batch)
    inputs, attrs = to_device(native("swa_attention", case[0])), case[1]
    fused, _, bf16_fused = three_ways("swa_attention", inputs, attrs)
    assert len(configs) == 4 and all(c is F.WIDE_GRID_CONFIG for c in configs), configs  # proj, wq_b, wo_a, wo_b
    assert rel_err(fused, bf16_fused) < 1e-2
    nbytes = K["attention"].attention_workspace([TensorSpec.of(t) for t in inputs], attrs, batch)
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=DEVICE)
    out = torch.full_like(fused, float("nan"))
    FUSED["swa_attention"]([t.clone() if i == 9 else t for i, t in enumerate(inputs)], [out], attrs, ws)
    assert torch.equal(out, fused)


# ---- selection --------------------------------------------------------------------------------


def _spec(fmt, shape):
    return TensorSpec.of(quantize_weight(torch.randn(*shape), fmt)) if fmt else TensorSpec(shape, torch.bfloat16)


def _moe_specs(routed, shared):
    x = TensorSpec((1, 128), torch.bfloat16)
    gate, bias = TensorSpec((4, 128), torch.bfloat16), TensorSpec((4,), torch.float32)
    experts = [_spec(routed, s) for s in ((4, 64, 128), (4, 128, 64), (4, 64, 128))]
    return [x, gate, bias, *experts, *(_spec(shared, s) for s in ((64, 128), (128, 64), (64, 128)))]


def _attention_specs(fmts):
    inputs, _ = attention_case(gen(360), batch=1)
    specs = [TensorSpec.of(t) for t in inputs]
    for i, fmt in zip((1, 3, 4, 6, 7), fmts):
        if fmt:
            specs[i] = TensorSpec.of(quantize_weight(inputs[i].float(), fmt))
    return specs


@pytest.fixture
def on_fake_device():
    """The fused impls registered for the meta device, as register_all does for CUDA."""
    meta = torch.device("meta")
    for name, impl in FUSED.items():
        register_fused(name, "meta", impl)
    register_fused("lm_head", "meta", lambda *a: None)  # a fused impl with no block-scaled rule
    yield meta
    for name in [*FUSED, "lm_head"]:
        get_op(name).fused.pop("meta", None)


def test_selection_takes_the_fused_impl_where_its_kernels_read_the_format(on_fake_device):
    meta, x = on_fake_device, TensorSpec((1, 128), torch.bfloat16)
    cases = [
        ("linear", [x, _spec("fp8", (256, 128))], True),
        ("linear", [x, _spec("mxfp4", (256, 128))], False),  # no MXFP4 GEMV
        ("linear", [x, _spec(None, (256, 128))], True),
        (
            "combiner",
            [
                x,
                x,
                TensorSpec((128,), torch.bfloat16),
                TensorSpec((128,), torch.bfloat16),
                _spec("fp8", (128, 128)),
                _spec(None, (128, 128)),
            ],
            True,
        ),
        *[("embed_combiner", [TensorSpec((1,), torch.int64), TensorSpec((1000, 128), torch.bfloat16), x,
                               TensorSpec((128,), torch.bfloat16), TensorSpec((128,), torch.bfloat16),
                               _spec(fmt, (128, 128)), _spec("fp8", (128, 128))], fmt != "mxfp4")
          for fmt in ("fp8", "mxfp4")],  # the combiner's rule, on the specs after the token and table
        ("moe", _moe_specs("mxfp4", "fp8"), True),
        ("moe", _moe_specs("fp8", "fp8"), False),  # the "fp8" checkpoint format: no FP8 expert kernel
        ("moe", _moe_specs("mxfp4", None), False),
        ("swa_attention", _attention_specs(["fp8"] * 5), True),
        ("swa_attention", _attention_specs(["fp8", "fp8", None, "fp8", "fp8"]), False),  # mixed
        ("lm_head", [x, TensorSpec((128,), torch.bfloat16), _spec("fp8", (1000, 128))], False),  # no rule
    ]
    for name, specs, fused in cases:
        op = get_op(name)
        got = select_impl(op, meta, "auto", specs)
        assert (got is op.fused["meta"]) == fused and (got is op.impl) != fused, (name, [s.short() for s in specs])
        assert (block_scaled_gap(op.fused["meta"], specs) is None) == fused, name
        assert select_impl(op, meta, "torch", specs) is op.impl  # kernels="torch" forces the torch op
        assert select_impl(op, meta, "compiled", specs) is op.impl
    assert "MXFP4 routed experts" in block_scaled_gap(get_op("moe").fused["meta"], _moe_specs("fp8", "fp8"))


# ---- the native chain through the fused impls -------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])  # 1: the MoE's one-row kernels (16-byte reads of x and act)
def test_native_chain_runs_the_fused_impls_and_drafts_as_the_torch_ops(tmp_path, monkeypatch, batch):
    """The small native checkpoint's K=2 chain at batch 1 and 3, each step's impl chosen as on CUDA.

    Every node reading a block-scaled weight takes its fused impl (no torch fallback inside), and
    the drafts equal the torch ops' wherever the top-2 logit gap is wider than bf16 noise.
    """
    from draftgraph.runtime.model.checkpoint_writer import write_checkpoint
    from draftgraph.runtime.model.config import V4Config
    from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

    cfg = V4Config.small()
    write_checkpoint(tmp_path, cfg, random_mtp_weights(cfg, seed=9), fmt="mxfp4")
    g = torch.Generator().manual_seed(1)
    hiddens = torch.randn(3, cfg.hc_mult, cfg.hidden_size, generator=g).bfloat16()[:batch]
    tokens, positions = [5, 77, 901][:batch], [30, 45, 7][:batch]

    def propose(fused: bool):
        prop = DeepseekV4MtpProposer.from_checkpoint(
            tmp_path, executor="eager", weights="native", kernels="torch", buckets=(batch,)
        )
        executor = prop._executor(batch, 2, False)
        chosen = []
        for step in executor.steps:
            specs = [executor.graph.values[n].spec for n in step.node.inputs if n in executor.graph.values]
            impl = FUSED.get(step.node.op)
            if fused and impl is not None and any(s.is_quantised for s in specs):
                assert block_scaled_gap(impl, specs) is None, step.node.op
                step.impl = impl
                chosen.append(step.node.op)
        states = [prop.alloc_state() for _ in range(batch)]
        drafts = prop.propose_batch(tokens, list(hiddens), positions, 2, states)
        return drafts, prop.last_hidden(batch).float(), chosen

    want, want_hidden, _ = propose(False)
    fallbacks = no_torch_fallback(monkeypatch)
    fp8_calls = uses(monkeypatch, K["fp8_linear"], "fp8_gemv")
    mx_calls = uses(monkeypatch, K["moe_mxfp4"], "moe_mxfp4_launches")
    got, hidden, chosen = propose(True)
    assert fallbacks == []
    # Per draft step: the combiner's one FP8 GEMV over both Ks (B x 4 stream rows, at most
    # COMBINER_MAX_ROWS), the attention's four, one MXFP4 MoE.
    assert batch * 4 <= K["combiner"].COMBINER_MAX_ROWS
    assert (len(fp8_calls), len(mx_calls)) == (2 * 5, 2), (len(fp8_calls), len(mx_calls))
    assert {"embed_combiner", "swa_attention"} <= set(chosen) and {"moe", "moe_hash"} & set(chosen), chosen
    assert rel_err(hidden, want_hidden) < 2e-2
    assert got == want, (got, want)


# ---- the benchmark's native path, dry ------------------------------------------------------------


def test_bench_draft_cpu_dry_run_builds_both_formats_and_binds_the_fused_impls():
    """bench_draft --cpu-dry-run: the issue-28 table's set-up (both formats from the same draws, floors
    from the bound chains' specs, the nodes that take fused kernels on CUDA) runs on CPU."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_draft.py", "--cpu-dry-run", "--cases", "1x1", "--weights",
         "native,bf16,native-w8a8"],
        cwd=root, capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    native = re.search(r"B=1 K=1 native: floor ([\d.]+) MB .* on CUDA (.*)", out)
    bf16 = re.search(r"B=1 K=1 +bf16: floor ([\d.]+) MB .* on CUDA (.*)", out)
    assert native and bf16, out
    assert native.group(2) == "embed_combiner:fused moe:fused swa_attention:fused", out
    assert bf16.group(2) == "no block-scaled node", out
    assert float(native.group(1)) < 0.7 * float(bf16.group(1)), out  # FP8 + MXFP4 bytes against bf16
    # native-w8a8: the native weight set with the reference's W8A8 numerics, the same fused impls
    w8a8 = re.search(r"B=1 K=1 native-w8a8: floor ([\d.]+) MB .*activations=(\w+).* on CUDA (.*)", out)
    assert w8a8 and w8a8.groups() == (native.group(1), "fp8", native.group(2)), out
    assert "activations=bf16" in native.group(0), out
