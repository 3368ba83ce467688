"""The MTP draft step and the K-draft chain, as one graph: the math, op by op (spec section 5).

One step declares the seven ops of the design, node names as in dumps::

    collapsed:  embed -> combiner -> hc_expand -> body -> hc_head -> lm_head -> argmax
    streams:    embed -> hc_expand -> combiner -> body -> hc_head -> lm_head -> argmax

The combiner is h_proj(hnorm(hidden)) + e_proj(enorm(embed)) (ops/combiner.py).
``streams`` mode (DeepSeek reference, default): the hidden is the target's pre-hc_head
streams [B, C, D]; the embedding is expanded to the C streams and the combiner works per
stream. Later steps take the MTP's own pre-hc_head streams. ``collapsed`` mode (the seed):
the hidden is [B, D]; the combiner sums the two projections and hc_expand replicates the
sum; later steps take the MTP's collapsed h_out. The body is one ``body`` node (ops/body.py):
the V4 block as its subgraph, or the runner the executor binds.

What makes the step fast is not written here but done by named passes (runtime/passes):
``fold_hc_expand`` computes the embedding half once and broadcasts it, ``view_single_stacks``
makes a K=1 chain's stacks views, ``reuse_dying_inputs`` lets hc_post and the norms write
over their dying inputs.

The chain unrolls the step K times in one graph: each draft's argmax feeds the next embed,
each step's hidden feeds the next combiner, and positions advance on the device
(``offset_positions``), so a whole propose is one graph run. With confidence gates, step k > 0
is guarded by its gate's flag (``Node.guard``): it runs only while some row is confident.

Sharded (``ChainSpec.shard``, runtime/model/sharding.py, docs/SHARDING.md): the chain of one rank
holds its head rows and ends each step's head in ``vocab_parallel_argmax``; its body's MoE is the
rank's share plus an ``all_reduce_sum`` (graphs/v4_block.py). A plan of world 1 builds today's chain.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from draftgraph.graphs.v4_block import CacheGeometry, Numerics, block_interface, build_block, weight_spec
from draftgraph.runtime.ir.builder import GraphBuilder
from draftgraph.runtime.ir.graph import Graph, Value
from draftgraph.runtime.ir.tensor_spec import B, TensorSpec
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.sharding import GROUP, ShardPlan

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
MODES = ("streams", "collapsed")


@dataclass(frozen=True)
class ChainSpec:
    """Everything that changes the chain graph's structure (a change means a new graph)."""

    num_drafts: int = 1
    mode: str = "streams"
    mtp_vocab_size: int = 0  # 0 = full vocab
    masked: bool = False  # grammar bitmask input present
    runner: str = "builtin"  # the body node's implementation: "builtin" is the op subgraph; else a runner
    runner_workspace_bytes: int = 0
    conf_tau: float = 0.0  # > 0: stop drafting once every row's confidence is below it (ops/draft_gate.py)
    numerics: Numerics = Numerics()  # weight formats, KV rounding, activations (graphs/v4_block.py)
    shard: ShardPlan | None = None  # this rank's part (runtime/model/sharding.py); None: unsharded

    @property
    def is_sharded(self) -> bool:
        return self.shard is not None and self.shard.is_sharded


def is_gated(conf_tau: float, num_drafts: int) -> bool:
    """Whether a chain has confidence gates: tau > 0 and a step after the first to gate."""
    return conf_tau > 0 and num_drafts > 1


def hidden_spec(config: V4Config, mode: str) -> TensorSpec:
    if mode == "streams":
        return TensorSpec((B, config.hc_mult, config.hidden_size), BF16)
    return TensorSpec((B, config.hidden_size), BF16)


def vocab_rows(config: V4Config, mtp_vocab_size: int) -> int:
    return min(mtp_vocab_size, config.vocab_size) if mtp_vocab_size > 0 else config.vocab_size


def mask_words(config: V4Config, mtp_vocab_size: int = 0) -> int:
    """int32 words of the grammar bitmask the graph reads: the drafted rows only."""
    return (vocab_rows(config, mtp_vocab_size) + 31) // 32


def chain_inputs(config: V4Config, geometry: CacheGeometry, spec: ChainSpec) -> dict[str, TensorSpec]:
    """The chain's graph inputs, in order."""
    if spec.mode not in MODES:
        from draftgraph.runtime.errors import GraphError

        raise GraphError(f"mode: expected one of {MODES}, got {spec.mode!r}")
    inputs = {
        "token": TensorSpec((B,), I64),
        "hidden": hidden_spec(config, spec.mode),
        "positions": TensorSpec((B,), I64),
        "kv_start": TensorSpec((B,), I32),
        "block_table": TensorSpec((B, geometry.max_blocks_per_seq), I32),
        "vocab_limit": TensorSpec((1,), I32),
    }
    if spec.masked:
        inputs["grammar_mask"] = TensorSpec((B, mask_words(config, spec.mtp_vocab_size)), I32)
    return inputs


def build_draft_chain(config: V4Config, geometry: CacheGeometry, spec: ChainSpec = ChainSpec()) -> Graph:
    """The K-draft chain. Outputs: ``drafts`` i64[B, K], ``probs`` f32[B, K], ``hidden_out``.

    With ``spec.conf_tau > 0`` (and K > 1) steps 1..K-1 are guarded by the chain's confidence
    gates: drafts a row does not keep are -1, and their probs and a skipped step's
    ``hidden_out`` are stale bytes (ops/draft_gate.py).
    """
    from draftgraph.runtime.errors import GraphError

    k = spec.num_drafts
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise GraphError(f"num_drafts: expected an int >= 1, got {k!r}")
    name = f"mtp_chain_k{spec.num_drafts}_{spec.mode}" + _rank_suffix(spec.shard)
    b = GraphBuilder(name)
    ins = {k: b.input(k, s) for k, s in chain_inputs(config, geometry, spec).items()}
    body = build_block(config, geometry, prefix="mtp.0.", name="mtp_body", numerics=spec.numerics,
                       shard=spec.shard) if spec.runner == "builtin" else None
    token, hidden = ins["token"], ins["hidden"]
    # A row whose hidden is not finite is dead from here on: it writes no cache row (ops/nonfinite.py).
    rows_at = b.op("drop_nonfinite", [ins["positions"], hidden], name="rows_at")  # [B]
    tokens, probs = [], []
    gated = is_gated(spec.conf_tau, spec.num_drafts)
    gate_values, alive, go = [], None, None
    for k in range(spec.num_drafts):
        if gated and k > 0:
            # The gate is not guarded itself: it always runs, and step k runs only where it sets go.
            with b.scoped(f"g{k}"):
                gate_inputs = [probs[-1], rows_at, ins["kv_start"]] + ([alive] if alive is not None else [])
                alive, go = b.op("draft_gate", gate_inputs, name="gate", attrs={"tau": float(spec.conf_tau)})
            gate_values += [alive, go]
        with b.scoped(f"d{k}"), (b.guarded(go) if go is not None else nullcontext()):
            positions = rows_at
            if k > 0:
                positions = b.op("offset_positions", [rows_at], name="positions", attrs={"offset": k})
            token, prob, hidden = _step(b, config, geometry, spec, ins, token, hidden, positions, body)
        tokens.append(token)
        probs.append(prob)
    drafts = b.op("stack", tokens, name="stacked_drafts")  # [B, K]
    if gated:
        drafts = b.op("cut_drafts", [drafts, *gate_values], name="cut_drafts")
    drafts = b.op("mark_dropped", [drafts, rows_at], name="drafts")
    confidences = b.op("stack", probs, name="probs")  # [B, K]
    b.output(drafts, confidences, hidden)
    graph = b.build()
    graph.meta.update({"num_drafts": spec.num_drafts, "mode": spec.mode, "runner": spec.runner,
                       "mtp_vocab_size": spec.mtp_vocab_size, "masked": spec.masked})
    if gated:
        graph.meta["conf_tau"] = float(spec.conf_tau)
    if spec.is_sharded:
        graph.meta.update({"rank": spec.shard.rank, "world": spec.shard.world})
    return graph


def _rank_suffix(shard: ShardPlan | None) -> str:
    return f"_rank{shard.rank}of{shard.world}" if shard is not None and shard.is_sharded else ""


def _step(b, config, geometry, spec, ins, token, hidden, positions, body) -> tuple[Value, Value, Value]:
    d, eps = config.hidden_size, float(config.rms_norm_eps)
    streams = combiner(b, config, token, hidden, spec.mode, spec.numerics)
    body_inputs = [streams, positions, ins["kv_start"], ins["block_table"]]
    out_streams = body_node(b, config, geometry, body_inputs, spec.runner, spec.runner_workspace_bytes, body)
    c = config.hc_mult
    head_weights = [
        b.weight("mtp.0.hc_head_fn", TensorSpec((c, c * d), F32)),
        b.weight("mtp.0.hc_head_base", TensorSpec((c,), F32)),
        b.weight("mtp.0.hc_head_scale", TensorSpec((1,), F32)),
    ]
    h_out = b.op("hc_head", [out_streams, *head_weights], name="hc_head",
                 attrs={"eps": eps, "hc_eps": float(config.hc_eps)})
    # Vocab-parallel (sharded): this rank's head rows only, and the argmax reduced across the ranks.
    shard = spec.shard if spec.is_sharded else None
    head_rows = shard.num_local_rows if shard else config.vocab_size
    logits = b.op(
        "lm_head",
        [h_out, b.weight("mtp.0.norm.weight", TensorSpec((d,), BF16)),
         b.weight("head.weight", weight_spec("head.weight", (head_rows, d), BF16, spec.numerics))],
        attrs={"eps": eps, "vocab_rows": head_rows if shard else vocab_rows(config, spec.mtp_vocab_size)},
    )
    sample_inputs = [logits, ins["vocab_limit"]] + ([ins["grammar_mask"]] if spec.masked else [])
    if shard:
        token, prob = b.op("vocab_parallel_argmax", sample_inputs, name="argmax",
                           attrs={"group": GROUP, "vocab": shard.drafted_vocab})
    else:
        token, prob = b.op("draft_argmax", sample_inputs, name="argmax")
    next_hidden = out_streams if spec.mode == "streams" else h_out
    return token, prob, next_hidden


def combiner(b: GraphBuilder, config: V4Config, token: Value, hidden: Value, mode: str,
             numerics: Numerics | None = None) -> Value:
    """embed, combiner and hc_expand: the body's input streams [B, C, D].

    Streams mode expands the embedding to the hidden's C streams before the combiner (the
    reference adds e_proj(e) to every stream); collapsed mode expands the combiner's sum.
    """
    d = config.hidden_size
    embed = b.op("embed", [token, b.weight("embed.weight", TensorSpec((config.vocab_size, d), BF16))])  # [B, D]
    weights = [
        b.weight("mtp.0.enorm.weight", TensorSpec((d,), BF16)),
        b.weight("mtp.0.hnorm.weight", TensorSpec((d,), BF16)),
        b.weight("mtp.0.e_proj.weight", weight_spec("mtp.0.e_proj.weight", (d, d), BF16, numerics)),
        b.weight("mtp.0.h_proj.weight", weight_spec("mtp.0.h_proj.weight", (d, d), BF16, numerics)),
    ]
    expand = {"hc_mult": config.hc_mult}
    eps = {"eps": float(config.rms_norm_eps)} | (numerics.linear_attrs() if numerics is not None else {})
    if mode == "streams":
        embed = b.op("hc_expand", [embed], name="hc_expand", attrs=expand)  # [B, C, D]
        return b.op("combiner", [embed, hidden, *weights], name="combiner", attrs=eps)  # [B, C, D]
    combined = b.op("combiner", [embed, hidden, *weights], name="combiner", attrs=eps)  # [B, D]
    return b.op("hc_expand", [combined], name="hc_expand", attrs=expand)  # [B, C, D]


def runner_interface(config: V4Config, geometry: CacheGeometry) -> dict[str, TensorSpec]:
    """What a body runner receives (in order) and must return: streams [B, C, D] bf16."""
    return block_interface(config, geometry)


def build_drafter_prefill(config: V4Config, geometry: CacheGeometry, mode: str = "streams",
                          runner: str = "builtin", runner_workspace_bytes: int = 0,
                          numerics: Numerics | None = None, shard: ShardPlan | None = None) -> Graph:
    """Write drafter KV rows for (token, hidden) pairs: embed -> combiner -> body, no LM head.

    Rows of one sequence at consecutive positions may share a batch: the attention
    writes every row's latent before any row reads, and a row reads only positions
    <= its own, so causality holds within the batch.
    """
    spec = ChainSpec(num_drafts=1, mode=mode, runner=runner, runner_workspace_bytes=runner_workspace_bytes)
    b = GraphBuilder(f"mtp_prefill_{mode}" + _rank_suffix(shard))
    ins = {k: b.input(k, s) for k, s in chain_inputs(config, geometry, spec).items() if k != "vocab_limit"}
    body = build_block(config, geometry, prefix="mtp.0.", name="mtp_body", numerics=numerics, shard=shard) \
        if runner == "builtin" else None
    with b.scoped("p"):
        streams = combiner(b, config, ins["token"], ins["hidden"], mode, numerics)
        body_inputs = [streams, ins["positions"], ins["kv_start"], ins["block_table"]]
        out = body_node(b, config, geometry, body_inputs, runner, runner_workspace_bytes, body)
    b.output(out)
    graph = b.build()
    graph.meta.update({"mode": mode, "runner": runner, "prefill": True})
    return graph


def body_node(b: GraphBuilder, config: V4Config, geometry: CacheGeometry, body_inputs, runner: str,
              workspace_bytes: int, block: Graph | None) -> Value:
    """The body as one ``body`` node: (streams, positions, kv_start, block_table, $kv_cache) -> streams.

    ``block``: the V4 block graph, the node's subgraph (the built-in runner); None: the runner
    named ``runner`` is bound by the executor, with ``workspace_bytes`` of scratch.
    """
    cache = b.state("mtp.0.kv_cache", TensorSpec((geometry.num_slots, config.cache_head_dim), BF16))
    attrs = {"runner": runner} if block is not None else {"runner": runner, "workspace_bytes": workspace_bytes}
    return b.op("body", [*body_inputs, cache], name="body", attrs=attrs, subgraph=block)
