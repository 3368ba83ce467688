"""What confidence gating costs and saves in a captured chain, at the real V4-Flash shapes (GPU).

    python benchmarks/bench_gate.py [--k 3] [--batch 1] [--config flash|small]

One process, random bf16 weights (~15 GB), fused kernels, captured. Rows (replay ms,
GPU time of the graph alone, replays back to back as in bench_draft):

- ungated K=1 and ungated K (draft_conf_tau = 0): the chains without gates;
- gated, every step runs (tau 1e-9): the K-1 IF nodes and gate ops when nothing is skipped;
- gated, stops after draft 1 (tau 1.0: no top-1 prob reaches 1): the K-1 steps skipped.

"per skipped step" is (ungated K - stopped) / (K - 1): what a skipped step saves; the
overhead of the gates is (every step runs - ungated K).
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_draft import random_weights, time_replays
from draftgraph.runtime.model.config import V4Config


def replay_ms(cfg, weights, batch: int, k: int, tau: float) -> tuple[float, float, list]:
    """(replay ms, spread, drafts of the first propose) of one captured proposer."""
    from draftgraph.runtime.proposer.proposer import DeepseekV4MtpProposer

    prop = DeepseekV4MtpProposer(cfg, weights, device="cuda", executor="captured", buckets=(batch,),
                                 num_cache_blocks=batch * 16, draft_conf_tau=tau)
    hiddens = [torch.randn(cfg.hc_mult, cfg.hidden_size, device="cuda").bfloat16() for _ in range(batch)]
    states = [prop.alloc_state() for _ in range(batch)]
    drafts = prop.propose_batch(list(range(1, batch + 1)), hiddens, [200] * batch, k, states)
    executor = next(iter(prop._executors.values()))
    ms, spread = time_replays(executor.replay)
    for state in states:
        prop.free_state(state)
    return ms, spread, drafts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("flash", "small"), default="flash")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    from draftgraph.runtime.execution import conditional as graph_conditional

    cfg = (V4Config.flash() if args.config == "flash" else V4Config.small()).replace(max_position_embeddings=4096)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  conditional nodes "
          f"{'available' if graph_conditional.is_available() else 'UNAVAILABLE (gates run unconditionally)'}")
    from draftgraph.runtime.proposer.binding import prepare_weights

    weights = prepare_weights(cfg, random_weights(cfg, torch.device("cuda")), torch.device("cuda"))
    b, k = args.batch, args.k
    rows = [("ungated K=1", 1, 0.0), (f"ungated K={k}", k, 0.0), (f"gated K={k}, every step runs", k, 1e-9),
            (f"gated K={k}, stops after draft 1", k, 1.0)]
    results = {}
    print(f"B={b}  {'variant':34} {'replay ms':>9} {'spread':>7}  drafts kept")
    for name, steps, tau in rows:
        ms, spread, drafts = replay_ms(cfg, weights, b, steps, tau)
        results[name] = ms
        print(f"       {name:34} {ms:9.3f} {spread:7.3f}  {[len(row) for row in drafts]}", flush=True)
    full, every, stopped = results[f"ungated K={k}"], results[f"gated K={k}, every step runs"], \
        results[f"gated K={k}, stops after draft 1"]
    summary = {"gates_overhead_ms": every - full, "saved_per_skipped_step_ms": (full - stopped) / (k - 1),
               "stopped_minus_ungated_k1_ms": stopped - results["ungated K=1"]}
    print(json.dumps({key: round(v, 4) for key, v in summary.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
