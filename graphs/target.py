"""The small V4-shaped target model as one graph over R token rows.

    embed -> hc_expand -> layers.0 .. layers.{L-1} -> hc_head -> lm_head -> argmax
                                                 \\-> hidden (what the MTP reads)

Every row is one token of one sequence at its own absolute position; rows of
one sequence share a block table. The batch dim ``B`` counts rows, not
sequences: a prompt of T tokens, or a verify window of K + 1 tokens, runs as T
(K + 1) rows of ONE graph run. That is causal because ``swa_attention`` writes
every row's latent into the cache before any row reads, and a row reads only
positions <= its own (note "rows are tokens").

Each layer ``i`` is :func:`draftgraph.graphs.v4_block.build_block` with prefix
``layers.{i}.`` and its own cache state ``layers.{i}.kv_cache``; the first
``num_hash_layers`` layers route their experts by token id (``moe_hash``).

Outputs: ``logits`` f32[B, V] (hc_head -> final norm -> head), ``next_token``
i64[B] (their argmax, so the host reads R ints, not R x V floats) and
``hidden``: the MTP's input for each row, the pre-hc_head streams [B, C, D]
(``streams`` mode) or the hc_head output before the final norm [B, D]
(``collapsed`` mode).
"""

from __future__ import annotations

import torch
from draftgraph.graphs.v4_block import CacheGeometry, build_block
from draftgraph.runtime.errors import GraphError, describe
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from draftgraph.runtime.model.config import V4Config

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
MODES = ("streams", "collapsed")


def target_inputs(geometry: CacheGeometry) -> dict[str, TensorSpec]:
    """The target graph's inputs, in order: token, positions, kv_start, block_table (one row per token)."""
    return {
        "token": TensorSpec((B,), I64),
        "positions": TensorSpec((B,), I64),
        "kv_start": TensorSpec((B,), I32),
        "block_table": TensorSpec((B, geometry.max_blocks_per_seq), I32),
    }


def layer_cache_name(i: int) -> str:
    return f"layers.{i}.kv_cache"


def build_target(config: V4Config, geometry: CacheGeometry, mode: str = "streams") -> Graph:
    """The target forward over R rows. Outputs: ``logits``, ``next_token``, ``hidden``.

    Example
    -------
    >>> g = build_target(V4Config.small(), CacheGeometry(num_slots=64, max_blocks_per_seq=4))
    >>> g.outputs
    ['logits', 'next_token', 'hidden']
    """
    if mode not in MODES:
        raise GraphError(describe("target mode", f"one of {MODES}", repr(mode)))
    if config.num_hidden_layers < 1:
        raise GraphError(describe("num_hidden_layers", ">= 1", config.num_hidden_layers))
    b = GraphBuilder(f"target_l{config.num_hidden_layers}_{mode}")
    ins = {k: b.input(k, s) for k, s in target_inputs(geometry).items()}
    d, c, eps = config.hidden_size, config.hc_mult, float(config.rms_norm_eps)
    embed = b.op("embed", [ins["token"], b.weight("embed.weight", TensorSpec((config.vocab_size, d), BF16))])
    streams = b.op("hc_expand", [embed], attrs={"hc_mult": c})  # [B, C, D]
    meta = [ins["positions"], ins["kv_start"], ins["block_table"]]
    for i in range(config.num_hidden_layers):
        hashed = i < config.num_hash_layers
        block = build_block(
            config,
            geometry,
            prefix=f"layers.{i}.",
            cache_name=layer_cache_name(i),
            hash_routed=hashed,
            name=f"layer{i}",
        )
        inputs = [streams, *meta] + ([ins["token"]] if hashed else [])
        streams = b.subgraph(f"layers.{i}", block, inputs)  # [B, C, D]
    head_weights = [
        b.weight("hc_head_fn", TensorSpec((c, c * d), F32)),
        b.weight("hc_head_base", TensorSpec((c,), F32)),
        b.weight("hc_head_scale", TensorSpec((1,), F32)),
    ]
    h = b.op(
        "hc_head", [streams, *head_weights], attrs={"eps": eps, "hc_eps": float(config.hc_eps)}
    )  # [B, D]
    logits = b.op(
        "lm_head",
        [
            h,
            b.weight("norm.weight", TensorSpec((d,), BF16)),
            b.weight("head.weight", TensorSpec((config.vocab_size, d), BF16)),
        ],
        name="logits",
        attrs={"eps": eps, "vocab_rows": 0},
    )  # [B, V] fp32
    next_token = b.op("argmax", [logits], name="next_token")  # [B]
    source = streams if mode == "streams" else h
    # A named view, so the MTP's input is called ``hidden`` in dumps and outputs whatever the mode.
    hidden = b.op("reshape", [source], name="hidden", attrs={"shape": list(source.spec.shape)})
    b.output(logits, next_token, hidden)
    graph = b.build()
    graph.meta.update({"mode": mode, "num_layers": config.num_hidden_layers, "target": True})
    return graph
