"""Random inputs for the V4 ops at V4Config.small() sizes, and a runner that goes through infer.

Only inputs live here; every float64 reference is written in its test file.
Values are seeded per call and never zero (weights scaled by 1/sqrt(fan_in) so
activations stay O(1), as in a trained model).
"""

from __future__ import annotations

import math

import torch
from draftgraph.runtime.ir.op_registry import get_op
from draftgraph.runtime.ir.tensor_spec import TensorSpec
from draftgraph.runtime.model.config import V4Config

CFG = V4Config.small()
BATCH = 3
BF16, F32 = torch.bfloat16, torch.float32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, scale: float = 1.0, dtype=BF16) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def weight(g: torch.Generator, out_features: int, in_features: int, dtype=BF16) -> torch.Tensor:
    return randn(g, out_features, in_features, scale=1 / math.sqrt(in_features), dtype=dtype)


def norm_weight(g: torch.Generator, n: int) -> torch.Tensor:
    return (1 + randn(g, n, scale=0.1, dtype=torch.float64)).to(BF16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def run_op(name: str, inputs, attrs, poison: bool = True) -> list[torch.Tensor]:
    """Infer output specs, allocate poisoned outputs, call impl; return the outputs."""
    op = get_op(name)
    specs = op.infer([TensorSpec.of(t) for t in inputs], attrs)
    outputs = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
    for out in outputs:
        out.fill_((float("nan") if out.is_floating_point() else -7) if poison else 0)
    result = op.impl(list(inputs), outputs, attrs, None)
    if result is not None:
        raise AssertionError(f"{name} impl returned {result!r}, expected None")
    return outputs


# ---- cases: (inputs, attrs) ------------------------------------------------------


def embed_case(g, batch=BATCH):
    token = torch.randint(0, CFG.vocab_size, (batch,), generator=g)
    return [token, randn(g, CFG.vocab_size, CFG.hidden_size)], {}


def combiner_case(g, batch=BATCH, streams=True):
    d = CFG.hidden_size
    h = randn(g, batch, CFG.hc_mult, d) if streams else randn(g, batch, d)
    weights = [norm_weight(g, d), norm_weight(g, d), weight(g, d, d), weight(g, d, d)]
    return [randn(g, batch, d), h, *weights], {"eps": CFG.rms_norm_eps}


def hc_expand_case(g, batch=BATCH):
    return [randn(g, batch, CFG.hidden_size)], {"hc_mult": CFG.hc_mult}


def hc_attrs(iters: int | None = None) -> dict:
    iters = CFG.hc_sinkhorn_iters if iters is None else iters
    return {"eps": CFG.rms_norm_eps, "hc_eps": CFG.hc_eps, "iters": iters}


def hc_pre_case(g, batch=BATCH, iters=None, hc_mult=None):
    c, d = hc_mult or CFG.hc_mult, CFG.hidden_size
    m = (2 + c) * c  # rows of fn: pre, post and the C x C comb logits
    X = randn(g, batch, c, d)
    fn = randn(g, m, c * d, scale=1 / math.sqrt(c * d), dtype=F32)
    base = randn(g, m, scale=0.5, dtype=F32)
    scale = (0.5 + torch.rand(3, generator=g)).to(F32)
    return [X, fn, base, scale], hc_attrs(iters)


def hc_pre_norm_case(g, batch=BATCH, iters=None, hc_mult=None):
    """hc_pre's case, then the weight of the norm that reads its y (the fold_norm_into_hc_pre pass's op)."""
    inputs, attrs = hc_pre_case(g, batch, iters, hc_mult)
    return [*inputs, norm_weight(g, CFG.hidden_size)], {**attrs, "norm_eps": CFG.rms_norm_eps}


def hc_post_case(g, batch=BATCH):
    c, d = CFG.hc_mult, CFG.hidden_size
    y, X = randn(g, batch, d), randn(g, batch, c, d)
    post = 2 * torch.sigmoid(randn(g, batch, c, dtype=F32))
    comb = torch.softmax(randn(g, batch, c, c, scale=2.0, dtype=F32), dim=-1)  # not symmetric
    return [y, X, post, comb], {}


def hc_head_case(g, batch=BATCH):
    c, d = CFG.hc_mult, CFG.hidden_size
    X = randn(g, batch, c, d)
    fn = randn(g, c, c * d, scale=1 / math.sqrt(c * d), dtype=F32)
    base = randn(g, c, scale=0.5, dtype=F32)
    scale = (0.5 + torch.rand(1, generator=g)).to(F32)
    return [X, fn, base, scale], {"eps": CFG.rms_norm_eps, "hc_eps": CFG.hc_eps}


def attention_attrs(**overrides) -> dict:
    attrs = {
        "num_heads": CFG.num_attention_heads,
        "head_dim": CFG.head_dim,
        "rope_dim": CFG.qk_rope_head_dim,
        "o_groups": CFG.o_groups,
        "o_lora_rank": CFG.o_lora_rank,
        "window": CFG.sliding_window,
        "rope_theta": CFG.rope_theta,
        "eps": CFG.rms_norm_eps,
        "block_size": 16,
        "kv_fp8_round": False,
    }
    return {**attrs, **overrides}


BLOCKS_PER_ROW = 4  # 64 positions per sequence


def attention_case(g, batch=BATCH, positions=None, kv_start=None, **attr_overrides):
    """Each row its own sequence; blocks drawn from a shuffled pool (non-contiguous, unordered)."""
    attrs = attention_attrs(**attr_overrides)
    h, d, dim, ql = CFG.num_attention_heads, CFG.head_dim, CFG.hidden_size, CFG.q_lora_rank
    groups, o_lora = CFG.o_groups, CFG.o_lora_rank
    num_blocks = BLOCKS_PER_ROW * batch + 5  # spare blocks stay unused
    pool = torch.randperm(num_blocks, generator=g)[: BLOCKS_PER_ROW * batch]
    table = pool.view(batch, BLOCKS_PER_ROW).to(torch.int32)
    default_positions = [5, 37, 50]
    positions = positions or [default_positions[i % 3] for i in range(batch)]
    kv_start = kv_start or [0] * batch
    inputs = [
        randn(g, batch, dim),  # x
        weight(g, ql, dim),  # wq_a
        norm_weight(g, ql),  # q_norm
        weight(g, h * d, ql),  # wq_b
        weight(g, d, dim),  # wkv
        norm_weight(g, d),  # kv_norm
        weight(g, groups * o_lora, h * d // groups),  # wo_a
        weight(g, dim, groups * o_lora),  # wo_b
        randn(g, h, dtype=F32),  # attn_sink
        randn(g, num_blocks * attrs["block_size"], d),  # kv_cache: earlier tokens' latents
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(kv_start, dtype=torch.int32),
        table,
    ]
    return inputs, attrs


def moe_weights(g):
    e, i, d = CFG.n_routed_experts, CFG.moe_intermediate_size, CFG.hidden_size
    w1 = randn(g, e, i, d, scale=1 / math.sqrt(d))
    w2 = randn(g, e, d, i, scale=1 / math.sqrt(i))
    w3 = randn(g, e, i, d, scale=1 / math.sqrt(d))
    return [w1, w2, w3, weight(g, i, d), weight(g, d, i), weight(g, i, d)]


def moe_attrs() -> dict:
    return {
        "top_k": CFG.num_experts_per_tok,
        "routed_scaling_factor": CFG.routed_scaling_factor,
        "swiglu_limit": CFG.swiglu_limit,
    }


def moe_case(g, batch=BATCH):
    x = randn(g, batch, CFG.hidden_size)
    gate_w = weight(g, CFG.n_routed_experts, CFG.hidden_size)
    bias = randn(g, CFG.n_routed_experts, scale=0.1, dtype=F32)
    return [x, gate_w, bias, *moe_weights(g)], moe_attrs()


def moe_hash_case(g, batch=BATCH):
    x = randn(g, batch, CFG.hidden_size)
    token = torch.randint(0, CFG.vocab_size, (batch,), generator=g)
    k, e = CFG.num_experts_per_tok, CFG.n_routed_experts
    tid2eid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(CFG.vocab_size)]).to(torch.int32)
    gate_w = weight(g, e, CFG.hidden_size)
    attrs = {k_: v for k_, v in moe_attrs().items() if k_ != "top_k"}
    return [x, token, tid2eid, gate_w, *moe_weights(g)], attrs


def lm_head_case(g, batch=BATCH, vocab_rows=0):
    d = CFG.hidden_size
    h = randn(g, batch, d, scale=3.0)
    inputs = [h, norm_weight(g, d), weight(g, CFG.vocab_size, d)]
    return inputs, {"eps": CFG.rms_norm_eps, "vocab_rows": vocab_rows}


def draft_argmax_case(g, batch=BATCH, with_mask=True, vocab=CFG.vocab_size, limit=None):
    logits = randn(g, batch, vocab, scale=3.0, dtype=F32)
    inputs = [logits, torch.tensor([vocab if limit is None else limit], dtype=torch.int32)]
    if with_mask:
        words = torch.randint(-(2**31), 2**31, (batch, -(-vocab // 32)), generator=g, dtype=torch.int64)
        inputs.append(words.to(torch.int32))
    return inputs, {}


def offset_positions_case(g, batch=BATCH):
    return [torch.randint(0, 1000, (batch,), generator=g)], {"offset": 3}


def minimum_case(g, batch=BATCH):
    return [torch.rand(batch, generator=g) + 0.01, torch.rand(batch, generator=g) + 0.01], {}


CASES = {
    "embed": embed_case,
    "combiner": combiner_case,
    "hc_expand": hc_expand_case,
    "hc_pre": hc_pre_case,
    "hc_pre_norm": hc_pre_norm_case,
    "hc_post": hc_post_case,
    "hc_head": hc_head_case,
    "swa_attention": attention_case,
    "moe": moe_case,
    "moe_hash": moe_hash_case,
    "lm_head": lm_head_case,
    "draft_argmax": draft_argmax_case,
    "offset_positions": offset_positions_case,
    "minimum": minimum_case,
}
