"""Torch-ops chain at V4-Flash B=1 K=1, captured: the urgent lane's priority on and off.

    python benchmarks/h200/scripts/lane_priority.py      # from the repo root, on a GPU

A scratch script kept for the numbers it gave (lane_priority_e3096ef.txt).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from scratch_common import profiled_kernels  # noqa: E402

from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from runtime.proposer import DeepseekV4MtpProposer  # noqa: E402
from tools.bench_draft import random_weights, time_replays  # noqa: E402

cfg = V4Config.flash().replace(max_position_embeddings=4096)
dev = torch.device("cuda", 0)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)

def build(k=1):
    prop = DeepseekV4MtpProposer(cfg, weights, device=dev, executor="captured", kernels="torch", buckets=(1,),
                                 num_cache_blocks=16)
    st = prop.alloc_state()
    h = torch.randn(cfg.hc_mult, cfg.hidden_size, device=dev).bfloat16()
    d = prop.propose(1, h, 200, k, st)
    st2 = st
    prop.after_verify(0, st2)
    prop.propose(1, h, 200, k, st2)  # second: the raw exec
    return prop, next(iter(prop._executors.values())), d

def lm_head_start(ex, launch):
    ks = profiled_kernels(launch, Path(os.environ.get("OUT", ".")) / "trace_tmp.json")
    t0 = ks[0]["ts"]
    lm = next(e for e in ks if "nvjet_sm90_tss_128x8" in e["name"])
    end = max(e["ts"] + e["dur"] for e in ks)
    return lm["ts"] - t0, end - t0, len(ks)

ref = None
for name in ["priority", "no-priority", "priority, torch exec", "priority again"]:
    if name == "no-priority":
        os.environ["DRAFTGRAPH_LANE_PRIORITY"] = "0"
    else:
        os.environ.pop("DRAFTGRAPH_LANE_PRIORITY", None)
    prop, ex, d = build()
    launch = ex.cuda_graph.replay if "torch exec" in name else ex.replay
    ms, spread = time_replays(launch)
    ref = ref or d
    lm, end, n = lm_head_start(ex, launch)
    print(f"{name:24s} replay {ms*1e3:7.1f} us spread {spread:.3f} own_exec {ex._own_exec is not None} "
          f"profiled: LM head at {lm:.0f} us, end {end:.0f} us, {n} kernels; drafts {'same' if d == ref else d}",
          flush=True)
    del prop, ex
    torch.cuda.empty_cache()
