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


def accepted_batch(positions: list[int], num_drafts: int, seed: int):
    """A TINY proposer and one state per position, after a batched propose of ``num_drafts`` at
    those positions with every draft accepted: (proposer, states, hiddens, the next positions)."""
    gen = torch.Generator().manual_seed(seed)
    prop = make_proposer(TINY)
    states = [prop.alloc_state() for _ in positions]
    hiddens = [hidden(TINY, gen) for _ in positions]
    prop.propose_batch(list(range(len(positions))), hiddens, positions, num_drafts, states)
    for state in states:
        prop.after_verify(num_drafts, state)
    return prop, states, hiddens, [p + num_drafts for p in positions]


def frozen(prop, states) -> tuple:
    """What a refused call must leave as it was: the states, the pool's free count, the cache rows."""
    return [s.snapshot() for s in states], prop.cache.num_free_blocks, prop.cache.kv.clone()


def assert_unchanged(prop, states, before) -> None:
    snaps, free, kv = before
    assert [s.snapshot() for s in states] == snaps
    assert prop.cache.num_free_blocks == free
    assert torch.equal(prop.cache.kv, kv)
