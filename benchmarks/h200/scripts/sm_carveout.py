"""Torch-ops chain at V4-Flash B=1 K=1, captured: SM carveout for GEMMs beside lane work, the MoE
up GEMM beside or inline, and the Sinkhorn by norm kernels; plus the Sinkhorn alone.

    python benchmarks/h200/scripts/sm_carveout.py      # from the repo root, on a GPU

A scratch script kept for the numbers it gave (sm_carveout_283311b.txt), run on 283311b with a
scratch patch: DRAFTGRAPH_SM_CARVEOUT (torch._C._set_sm_carveout_experimental while lane work
ran), DRAFTGRAPH_MOE_UP_BESIDE and DRAFTGRAPH_SINKHORN=norms. Neither switch is on main: the
carveout and the inline up GEMM gained nothing, and the Sinkhorn by norm kernels became the
only Sinkhorn (ops/mhc.py). On main the script runs every variant the same way.
"""

import os
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops.mhc import sinkhorn  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from runtime.proposer import DeepseekV4MtpProposer  # noqa: E402
from tools.bench_draft import random_weights, time_replays  # noqa: E402

dev = torch.device("cuda", 0)


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        fn()
    g.instantiate()
    from cuda.bindings import runtime as cr

    err, _, n = cr.cudaGraphGetNodes(g.raw_cuda_graph(), 0)
    return g, n


def micro():
    x = torch.randn(8, 8, 1, device=dev)
    w, b = torch.ones(8, device=dev), torch.zeros(8, device=dev)
    for name, fn in [
        ("batch_norm [8,8,1] train", lambda: F.batch_norm(x, None, None, w, b, training=True, eps=1.6e-5)),
        ("layer_norm [8,8]", lambda: F.layer_norm(x.view(8, 8), (8,), w, None, eps=1.6e-5)),
        ("sum(-2) + div_", lambda: x.view(8, 8).div_(x.view(8, 8).sum(-2, keepdim=True))),
    ]:
        g, n = graph_of(fn)
        ms, _ = time_replays(g.replay)
        print(f"{name:28s} {n} nodes  {ms*1e3:6.1f} us per replay", flush=True)
    L = torch.randn(1, 4, 4, device=dev) * 3
    out = torch.empty(1, 4, 4, device=dev)
    for mode in ("default", "norms"):
        os.environ["DRAFTGRAPH_SINKHORN"] = mode
        g, n = graph_of(lambda: sinkhorn(L, 20, 1e-6, out=out))
        ms, _ = time_replays(g.replay)
        g.replay()
        torch.cuda.synchronize()
        print(f"sinkhorn B=1 {mode:8s}         {n} nodes  {ms*1e3:6.1f} us per replay  row/col sums "
              f"{out.sum(-1).sub(1).abs().max().item():.1e} {out.sum(-2).sub(1).abs().max().item():.1e}", flush=True)
    os.environ.pop("DRAFTGRAPH_SINKHORN")


micro()
t0 = time.time()
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
print(f"weights {time.time() - t0:.0f} s", flush=True)
gen = torch.Generator(device=dev).manual_seed(0)
hidden = torch.randn(cfg.hc_mult, cfg.hidden_size, device=dev, generator=gen).bfloat16()


def build(k=1):
    prop = DeepseekV4MtpProposer(cfg, weights, device=dev, executor="captured", kernels="torch", buckets=(1,),
                                 num_cache_blocks=16)
    st = prop.alloc_state()
    d = prop.propose(1, hidden, 200, k, st)
    prop.after_verify(0, st)
    prop.propose(1, hidden, 200, k, st)  # second: the raw exec
    return prop, next(iter(prop._executors.values())), d


VARIANTS = [
    ("base", {}),
    ("carve 4", {"DRAFTGRAPH_SM_CARVEOUT": "4"}),
    ("carve 8", {"DRAFTGRAPH_SM_CARVEOUT": "8"}),
    ("carve 16", {"DRAFTGRAPH_SM_CARVEOUT": "16"}),
    ("up inline", {"DRAFTGRAPH_MOE_UP_BESIDE": "0"}),
    ("up inline carve 4", {"DRAFTGRAPH_MOE_UP_BESIDE": "0", "DRAFTGRAPH_SM_CARVEOUT": "4"}),
    ("up inline carve 8", {"DRAFTGRAPH_MOE_UP_BESIDE": "0", "DRAFTGRAPH_SM_CARVEOUT": "8"}),
    ("up inline carve 16", {"DRAFTGRAPH_MOE_UP_BESIDE": "0", "DRAFTGRAPH_SM_CARVEOUT": "16"}),
    ("norms", {"DRAFTGRAPH_SINKHORN": "norms"}),
    ("norms carve 8", {"DRAFTGRAPH_SINKHORN": "norms", "DRAFTGRAPH_SM_CARVEOUT": "8"}),
    ("norms up inline carve 8", {"DRAFTGRAPH_SINKHORN": "norms", "DRAFTGRAPH_MOE_UP_BESIDE": "0",
                                 "DRAFTGRAPH_SM_CARVEOUT": "8"}),
    ("base again", {}),
]
KEYS = ("DRAFTGRAPH_SM_CARVEOUT", "DRAFTGRAPH_MOE_UP_BESIDE", "DRAFTGRAPH_SINKHORN")
ref = None
for name, env in VARIANTS:
    for key in KEYS:
        os.environ.pop(key, None)
    os.environ.update(env)
    prop, ex, d = build()
    ms, spread = time_replays(ex.replay)
    ms2, _ = time_replays(ex.replay)
    ref = ref or d
    print(f"{name:26s} replay {ms*1e3:7.1f} / {ms2*1e3:7.1f} us spread {spread:.3f}  "
          f"drafts {'same' if d == ref else d}", flush=True)
    del prop, ex
    torch.cuda.empty_cache()
