"""The sharded chain on 2 GPUs over NCCL: the captured replay equals the eager run bit for bit (cuda-marked).

Each rank builds two proposers on its GPU with the default group: captured (the collectives
inside the CUDA graph, the arena poisoned before every replay) and eager, and makes the same
calls with each (a drafter prefill, propose_batch at K=1 and K=3 in buckets 1 and 4, propose
with a grammar mask, a runtime vocab limit). Drafts, confidences and the final hidden must be
equal bit for bit, and the drafts equal to an unsharded eager proposer's on the same weights.
Skipped without two GPUs. Never run on a GPU yet (written on a CPU-only machine).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer
from rank_processes import results, run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs (NCCL)"),
]

CFG = V4Config.small()


def _drive(prop: DeepseekV4MtpProposer) -> dict:
    """The same calls on every rank and proposer: drafts, confidences and hiddens (on the CPU)."""
    device = prop.device
    g = torch.Generator(device=device).manual_seed(5)
    shape = (CFG.hc_mult, CFG.hidden_size)
    out = {"drafts": [], "conf": [], "hidden": []}
    states = [prop.alloc_state() for _ in range(4)]
    for s in states:
        prop.prefill_drafter([1, 2, 3, 4, 5], torch.randn(5, *shape, device=device, generator=g).bfloat16(), s)
    position = 4
    for n, k in ((1, 1), (4, 1), (4, 3), (1, 3)):
        hiddens = torch.randn(n, *shape, device=device, generator=g).bfloat16()
        conf = []
        out["drafts"].append(prop.propose_batch(list(range(10, 10 + n)), hiddens, [position] * n, k, states[:n],
                                                out_conf=conf))
        out["conf"].append(conf)
        out["hidden"].append(prop.last_hidden(n).cpu())
        prop.after_verify_batch([0] * n, states[:n])
    words = (CFG.vocab_size + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (words,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    out["drafts"].append(prop.propose(3, torch.randn(*shape, device=device, generator=g).bfloat16(), position, 3,
                                      states[0], grammar_bitmask=mask.to(torch.int32)))
    prop.after_verify(0, states[0])
    prop.set_vocab_limit(300)
    out["drafts"].append(prop.propose_batch([1, 2, 3, 4], torch.randn(4, *shape, device=device, generator=g).bfloat16(),
                                            [position] * 4, 2, states))
    return out


def _captured_and_eager(rank: int, world: int, device_type: str = "cuda") -> tuple:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    weights = random_mtp_weights(CFG, seed=7)
    common = dict(device=device, buckets=(1, 4), mtp_vocab_size=640)
    captured = _drive(DeepseekV4MtpProposer(CFG, weights, process_group=dist.group.WORLD, poison_arena=True,
                                            executor="captured" if device_type == "cuda" else "eager", **common))
    eager = _drive(DeepseekV4MtpProposer(CFG, weights, process_group=dist.group.WORLD, executor="eager", **common))
    whole = _drive(DeepseekV4MtpProposer(CFG, weights, executor="eager", **common))  # unsharded, no comm
    return captured, eager, whole


def check(per_rank) -> None:
    for rank, (captured, eager, whole) in enumerate(per_rank):
        assert captured["drafts"] == eager["drafts"] and captured["conf"] == eager["conf"], rank  # exact
        assert all(torch.equal(c, e) for c, e in zip(captured["hidden"], eager["hidden"])), rank
        assert eager["drafts"] == whole["drafts"], rank
    assert per_rank[0][0]["drafts"] == per_rank[1][0]["drafts"]  # every rank drafts the same


def test_captured_sharded_replay_equals_eager_bit_for_bit(tmp_path):
    check(results(run_ranks(2, _captured_and_eager, folder=tmp_path, backend="nccl", timeout=600)))
