"""The V4 block as a graph: the MTP's ``body`` and each layer of the small target.

hc_pre -> attn_norm -> swa_attention -> hc_post -> hc_pre -> ffn_norm -> moe -> hc_post
(spec section 2, "Block"). Weights are named as in the checkpoint under
``prefix`` (``mtp.0.`` or ``layers.{i}.``); the routed experts are stacked
once at load into ``{prefix}ffn.experts.stacked.{w1,w2,w3}`` [E, ...].

Design note "numerics": :class:`Numerics` says how the block computes where a checkpoint
allows a choice. ``formats`` names the weights kept in the checkpoint's block-scaled format
(their specs say so: ``f8e4m3[..] scale ue8m0[..]``); ``kv_fp8_round`` rounds the latent's
non-rotary part through FP8 as the reference's cache does; ``activations="fp8"`` quantises
the input of every block-scaled linear to FP8 per 1x128 run (W8A8, as the reference and
vLLM's block-FP8 path). The defaults are today's bf16 numerics; attrs appear on the nodes
only when set, so a bf16 graph prints as it did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.tensor_spec import QUANTS, B, TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import quant_scale_shape
from draftgraph.runtime.model.sharding import GROUP, ShardPlan
from draftgraph.runtime.model.weight_names import MTP_TENSOR_NAMES, check_format, stored_kind

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64


@dataclass(frozen=True)
class CacheGeometry:
    """Static sizes of a paged latent cache, as the graph sees them."""

    num_slots: int  # num_blocks * block_size
    max_blocks_per_seq: int
    block_size: int = 16


ACTIVATION_MODES = ("bf16", "fp8")


@dataclass(frozen=True)
class Numerics:
    """How a block computes (design note "numerics"); part of a graph's structure, so hashable."""

    formats: tuple[tuple[str, str], ...] = ()  # sorted (weight name, "fp8" | "mxfp4"): kept block-scaled
    kv_fp8_round: bool = False
    activations: str = "bf16"  # "fp8": W8A8 on the block-scaled linears

    def format_of(self, name: str) -> str | None:
        return dict(self.formats).get(name)

    def linear_attrs(self) -> dict:
        """The attrs of an op reading block-scaled linears: none unless activations are FP8."""
        return {"activations": "fp8"} if self.activations == "fp8" and self.formats else {}


def weight_spec(name: str, shape: tuple[int, ...], dtype: torch.dtype, numerics: Numerics | None) -> TensorSpec:
    """The spec of weight ``name`` of logical ``shape``: as ``dtype``, or in its block-scaled format."""
    fmt = numerics.format_of(name) if numerics is not None else None
    if fmt is None:
        return TensorSpec(shape, dtype)
    data = shape if fmt == "fp8" else (*shape[:-1], shape[-1] // 2)
    return TensorSpec(data, QUANTS[fmt], fmt, TensorSpec(quant_scale_shape(fmt, shape), torch.float8_e8m0fnu))


def checkpoint_formats(config: V4Config, fmt: str = "mxfp4", prefix: str = "mtp.0.") -> tuple[tuple[str, str], ...]:
    """The graph weights a checkpoint written in ``fmt`` keeps block-scaled (no weights needed).

    ``fmt="mxfp4"`` is DeepSeek-V4's own layout: routed experts MXFP4, the other linears FP8.
    The routed experts appear under their stacked names (runtime/proposer/binding.py).
    """
    check_format(fmt)
    formats = {}
    for entry in MTP_TENSOR_NAMES(config):
        kind = stored_kind(entry.kind, fmt)
        if kind in QUANTS:
            formats[entry.name] = kind
    for w in ("w1", "w2", "w3"):
        kind = formats.get(f"{prefix}ffn.experts.0.{w}.weight")
        if kind is not None:
            formats[f"{prefix}ffn.experts.stacked.{w}"] = kind
    return tuple(sorted((n, f) for n, f in formats.items() if ".experts." not in n or ".stacked." in n))


def numerics_for(formats: Iterable[tuple[str, str]], kv_fp8_round: bool = False,
                 activations: str = "bf16") -> Numerics:
    return Numerics(tuple(sorted(formats)), bool(kv_fp8_round), activations)


def block_interface(config: V4Config, geometry: CacheGeometry, hash_routed: bool = False) -> dict[str, TensorSpec]:
    """The body's inputs, in order: streams, positions, kv_start, block_table (+ token if hash-routed)."""
    c, d = config.hc_mult, config.hidden_size
    specs = {
        "streams": TensorSpec((B, c, d), BF16),
        "positions": TensorSpec((B,), I64),
        "kv_start": TensorSpec((B,), I32),
        "block_table": TensorSpec((B, geometry.max_blocks_per_seq), I32),
    }
    if hash_routed:
        specs["token"] = TensorSpec((B,), I64)
    return specs


def attention_attrs(config: V4Config, geometry: CacheGeometry) -> dict:
    return {
        "num_heads": config.num_attention_heads,
        "head_dim": config.head_dim,
        "rope_dim": config.qk_rope_head_dim,
        "o_groups": config.o_groups,
        "o_lora_rank": config.o_lora_rank,
        "window": config.sliding_window,
        "rope_theta": float(config.rope_theta),
        "eps": float(config.rms_norm_eps),
        "block_size": geometry.block_size,
    }


def hc_attrs(config: V4Config) -> dict:
    return {"eps": float(config.rms_norm_eps), "hc_eps": float(config.hc_eps), "iters": config.hc_sinkhorn_iters}


def build_block(
    config: V4Config,
    geometry: CacheGeometry,
    prefix: str = "mtp.0.",
    cache_name: str | None = None,
    hash_routed: bool = False,
    name: str = "v4_block",
    numerics: Numerics | None = None,
    shard: ShardPlan | None = None,
) -> Graph:
    """One V4 block as a graph whose inputs are :func:`block_interface`; output: streams [B, C, D].

    ``numerics``: weight formats, KV rounding and activation precision (design note "numerics").
    ``shard``: this rank's part of a sharded block (runtime/model/sharding.py); None or a world
    of 1: the whole block.
    """
    numerics = numerics or Numerics()
    b = GraphBuilder(name)
    ins = {k: b.input(k, s) for k, s in block_interface(config, geometry, hash_routed).items()}
    x = ins["streams"]
    cache = b.state(cache_name or f"{prefix}kv_cache", TensorSpec((geometry.num_slots, config.cache_head_dim), BF16))
    x = _attention_half(b, config, geometry, prefix, x, ins, cache, numerics)
    x = _ffn_half(b, config, prefix, x, ins, hash_routed, numerics, shard)
    b.output(x)
    return b.build()


def _hc_weights(b: GraphBuilder, config: V4Config, prefix: str, which: str):
    c, d, m = config.hc_mult, config.hidden_size, config.hc_mix_dim
    return [
        b.weight(f"{prefix}hc_{which}_fn", TensorSpec((m, c * d), F32)),
        b.weight(f"{prefix}hc_{which}_base", TensorSpec((m,), F32)),
        b.weight(f"{prefix}hc_{which}_scale", TensorSpec((3,), F32)),
    ]


def _attention_half(b, config, geometry, prefix, x, ins, cache, numerics):
    d, h, hd = config.hidden_size, config.num_attention_heads, config.head_dim
    q_lora, g, o_lora = config.q_lora_rank, config.o_groups, config.o_lora_rank
    y, post, comb = b.op("hc_pre", [x, *_hc_weights(b, config, prefix, "attn")], name="hc_pre_attn",
                         attrs=hc_attrs(config))
    normed = b.op("rms_norm", [y, b.weight(f"{prefix}attn_norm.weight", TensorSpec((d,), BF16))],
                  name="attn_norm", attrs={"eps": float(config.rms_norm_eps)})
    a = f"{prefix}attn."
    weights = [
        b.weight(a + "wq_a.weight", weight_spec(a + "wq_a.weight", (q_lora, d), BF16, numerics)),
        b.weight(a + "q_norm.weight", TensorSpec((q_lora,), BF16)),
        b.weight(a + "wq_b.weight", weight_spec(a + "wq_b.weight", (h * hd, q_lora), BF16, numerics)),
        b.weight(a + "wkv.weight", weight_spec(a + "wkv.weight", (hd, d), BF16, numerics)),
        b.weight(a + "kv_norm.weight", TensorSpec((hd,), BF16)),
        b.weight(a + "wo_a.weight", weight_spec(a + "wo_a.weight", (g * o_lora, h * hd // g), BF16, numerics)),
        b.weight(a + "wo_b.weight", weight_spec(a + "wo_b.weight", (d, g * o_lora), BF16, numerics)),
        b.weight(a + "attn_sink", TensorSpec((h,), F32)),
    ]
    meta = [ins["positions"], ins["kv_start"], ins["block_table"]]
    attrs = attention_attrs(config, geometry) | numerics.linear_attrs()
    if numerics.kv_fp8_round:
        attrs["kv_fp8_round"] = True
    attn = b.op("swa_attention", [normed, *weights, cache, *meta], name="attn", attrs=attrs)
    return b.op("hc_post", [attn, x, post, comb], name="hc_post_attn")


def _ffn_half(b, config, prefix, x, ins, hash_routed, numerics, shard=None):
    d, e, inter = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    k = config.num_experts_per_tok
    y, post, comb = b.op("hc_pre", [x, *_hc_weights(b, config, prefix, "ffn")], name="hc_pre_ffn",
                         attrs=hc_attrs(config))
    normed = b.op("rms_norm", [y, b.weight(f"{prefix}ffn_norm.weight", TensorSpec((d,), BF16))],
                  name="ffn_norm", attrs={"eps": float(config.rms_norm_eps)})
    f = f"{prefix}ffn."
    if shard is not None and shard.is_sharded:
        if hash_routed:
            from draftgraph.runtime.errors import GraphError

            raise GraphError("a sharded block: score-routed MoE only (the MTP layer's); hash-routed layers are the "
                             "target's")
        out = _expert_parallel_moe(b, config, f, normed, numerics, shard)
        return b.op("hc_post", [out, x, post, comb], name="hc_post_ffn")
    gate = b.weight(f + "gate.weight", TensorSpec((e, d), BF16))
    shapes = [("experts.stacked.w1", (e, inter, d)), ("experts.stacked.w2", (e, d, inter)),
              ("experts.stacked.w3", (e, inter, d)), ("shared_experts.w1.weight", (inter, d)),
              ("shared_experts.w2.weight", (d, inter)), ("shared_experts.w3.weight", (inter, d))]
    experts = [b.weight(f + n, weight_spec(f + n, shape, BF16, numerics)) for n, shape in shapes]
    attrs = {"top_k": k, "routed_scaling_factor": float(config.routed_scaling_factor),
             "swiglu_limit": float(config.swiglu_limit)} | numerics.linear_attrs()
    if hash_routed:
        tid2eid = b.weight(f + "gate.tid2eid", TensorSpec((config.vocab_size, k), I32))
        out = b.op("moe_hash", [normed, ins["token"], tid2eid, gate, *experts], name="moe", attrs=attrs)
    else:
        bias = b.weight(f + "gate.bias", TensorSpec((e,), F32))
        out = b.op("moe", [normed, gate, bias, *experts], name="moe", attrs=attrs)
    return b.op("hc_post", [out, x, post, comb], name="hc_post_ffn")


def _expert_parallel_moe(b, config, f, normed, numerics, shard: ShardPlan):
    """moe_shard (routing over every expert, this rank's experts, the shared expert on rank 0) -> fp32
    partial [B, D] -> all_reduce_sum -> one rounding to bf16: the ranks' partials add in fp32, as the
    unsharded MoE adds its pairs in fp32 and rounds once."""
    d, e, inter = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    local = shard.num_local_experts
    weights = [b.weight(f + "gate.weight", TensorSpec((e, d), BF16)), b.weight(f + "gate.bias", TensorSpec((e,), F32))]
    shapes = [("experts.stacked.w1", (local, inter, d)), ("experts.stacked.w2", (local, d, inter)),
              ("experts.stacked.w3", (local, inter, d))]
    if shard.holds_shared:
        shapes += [("shared_experts.w1.weight", (inter, d)), ("shared_experts.w2.weight", (d, inter)),
                   ("shared_experts.w3.weight", (inter, d))]
    weights += [b.weight(f + n, weight_spec(f + n, shape, BF16, numerics)) for n, shape in shapes]
    attrs = {"top_k": config.num_experts_per_tok, "routed_scaling_factor": float(config.routed_scaling_factor),
             "swiglu_limit": float(config.swiglu_limit), "expert_start": shard.expert_start} | numerics.linear_attrs()
    partial = b.op("moe_shard", [normed, *weights], name="moe", attrs=attrs)  # [B, D] fp32
    total = b.op("all_reduce_sum", [partial], name="moe_reduce", attrs={"group": GROUP})
    return b.op("cast", [total], name="moe_round", attrs={"dtype": "bf16"})
