"""Torch-ops chain at V4-Flash B=1 K=1, captured: replay time of a few variants (switched by
environment variables), and the kernel timeline of one replay per stream.

    python benchmarks/h200/scripts/timeline.py OUT_DIR      # from the repo root, on a GPU

A scratch script kept for the numbers it gave. The timeline comes from a torch.profiler trace
of the third of three replays through torch's exec (the profiler slows the raw launch).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from scratch_common import replay_timeline  # noqa: E402

from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from runtime.proposer import DeepseekV4MtpProposer  # noqa: E402
from tools.bench_draft import random_weights, time_replays  # noqa: E402

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
hidden = torch.randn(cfg.hc_mult, cfg.hidden_size, device=dev,
                     generator=torch.Generator(device=dev).manual_seed(0)).bfloat16()


def build(k=1):
    prop = DeepseekV4MtpProposer(cfg, weights, device=dev, executor="captured", kernels="torch", buckets=(1,),
                                 num_cache_blocks=16)
    st = prop.alloc_state()
    d = prop.propose(1, hidden, 200, k, st)
    prop.after_verify(0, st)
    prop.propose(1, hidden, 200, k, st)
    return prop, next(iter(prop._executors.values())), d


# (name, environment, trace): variants switched by environment variables, when a change has one.
VARIANTS = [
    ("base", {}, True),
    ("base again", {}, False),
]
KEYS = {key for _, env, _ in VARIANTS for key in env}
ref = None
for name, env, trace in VARIANTS:
    for key in KEYS:
        os.environ.pop(key, None)
    os.environ.update(env)
    prop, ex, d = build()
    ms, spread = time_replays(ex.replay)
    ms2, _ = time_replays(ex.replay)
    ref = ref or d
    print(f"{name:26s} replay {ms*1e3:7.1f} / {ms2*1e3:7.1f} us spread {spread:.3f}  "
          f"drafts {'same' if d == ref else d}", flush=True)
    if trace:
        text = replay_timeline(ex.cuda_graph.replay, out_dir / "trace.json")
        (out_dir / f"timeline_{name.replace(' ', '_').replace('+', 'and')}.txt").write_text(text + "\n")
    del prop, ex
    torch.cuda.empty_cache()
