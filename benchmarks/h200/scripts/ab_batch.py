"""Scratch A/B: the current torch ops against the division Sinkhorn (283311b) and the one-block
kv path (918df27), at B=1 and B=32, K=1, V4-Flash shapes, captured replay us.

Kept for the numbers it gave (ab_batch_b8fcadc.txt). It imported _old_mhc.py and
_old_attention.py: ``git show 283311b:ops/mhc.py`` and ``git show 918df27:ops/attention.py``
with their ``register(`` calls made no-ops, put beside it for the run and not committed.
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks/h200/scripts"))

import _old_attention  # noqa: E402
import _old_mhc  # noqa: E402
import torch  # noqa: E402

import ops.mhc  # noqa: E402
from ops import registry  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from runtime.proposer import DeepseekV4MtpProposer  # noqa: E402
from tools.bench_draft import random_weights, time_replays  # noqa: E402

dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
new_sinkhorn, new_attn = ops.mhc.sinkhorn, registry.get_op("swa_attention")


def build(batch):
    prop = DeepseekV4MtpProposer(cfg, weights, device=dev, executor="captured", kernels="torch", buckets=(batch,),
                                 num_cache_blocks=batch * 16)
    gen = torch.Generator(device=dev).manual_seed(batch)
    hs = [torch.randn(cfg.hc_mult, cfg.hidden_size, device=dev, generator=gen).bfloat16() for _ in range(batch)]
    sts = [prop.alloc_state() for _ in range(batch)]
    d = prop.propose_batch(list(range(1, batch + 1)), hs, [200] * batch, 1, sts)
    for s in sts:
        prop.after_verify(0, s)
    prop.propose_batch(list(range(1, batch + 1)), hs, [200] * batch, 1, sts)
    return prop, next(iter(prop._executors.values())), d


old_attn = dataclasses.replace(new_attn, impl=_old_attention._attn_impl)
for batch in (32, 1):
    for name, sk, attn in [("current", new_sinkhorn, new_attn), ("division sinkhorn", _old_mhc.sinkhorn, new_attn),
                           ("one-block kv path", new_sinkhorn, old_attn), ("current again", new_sinkhorn, new_attn)]:
        ops.mhc.sinkhorn = sk
        registry._REGISTRY["swa_attention"] = attn
        prop, ex, d = build(batch)
        ms, spread = time_replays(ex.replay)
        print(f"B={batch:2d} {name:20s} replay {ms*1e3:7.1f} us spread {spread:.3f}", flush=True)
        del prop, ex
        torch.cuda.empty_cache()
