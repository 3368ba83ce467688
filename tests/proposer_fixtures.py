"""Shared configs and helpers for the proposer tests."""

from __future__ import annotations

import torch
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

SMALL = V4Config.small()
# A quarter of SMALL's width (64 wide, 2 heads) for the fast proposer tests; decode_fixtures widens its vocab.
TINY = V4Config.small(
    hidden_size=64, num_attention_heads=2, head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=16,
    vocab_size=100, n_routed_experts=4, moe_intermediate_size=32, max_position_embeddings=512,
)


def make_proposer(cfg=SMALL, seed=0, **kw) -> DeepseekV4MtpProposer:
    kw.setdefault("executor", "eager")
    return DeepseekV4MtpProposer(cfg, random_mtp_weights(cfg, seed=seed), **kw)


def hidden(cfg, gen, mode="streams", n=None):
    shape = (cfg.hc_mult, cfg.hidden_size) if mode == "streams" else (cfg.hidden_size,)
    if n is not None:
        shape = (n, *shape)
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def cache_snapshot(prop) -> tuple:
    return (prop.cache.num_free_blocks, prop.cache.kv.clone())
