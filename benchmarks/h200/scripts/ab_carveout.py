"""Scratch A/B (H200, V4-Flash shapes, torch ops, captured replay us): SM carveout for the big GEMMs.

Why: a Sinkhorn kernel is one block; while a persistent grouped GEMM (all SMs, for its whole
run) or a big cuBLAS GEMV holds every SM, the next Sinkhorn kernel waits for it to end, and
the Sinkhorn is the chain's critical path beside the attention and the MoE. With
torch._C._set_sm_carveout_experimental(n) set while they launch (torch's grouped GEMM and
cuBLAS read it at launch, so the capture keeps it), those GEMMs leave n SMs free.

- "moe n": the three routed-expert grouped GEMMs with n SMs carved out;
- "attn n": the whole attention op (its cuBLAS GEMVs) with n SMs carved out.

    python benchmarks/h200/scripts/ab_carveout.py OUT_DIR
"""

import contextlib
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from scratch_common import print_variants  # noqa: E402

from ops.registry import get_op  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from tools.bench_draft import random_weights  # noqa: E402


@contextlib.contextmanager
def carved(n: int):
    old = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(n or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(old)


REAL = {"gmm": torch._grouped_mm, "attn": get_op("swa_attention").impl}


def variant(name):
    moe = re.search(r"moe (\d+)", name)
    attn = re.search(r"attn (\d+)", name)

    def gmm(*args, **kwargs):
        with carved(int(moe.group(1))):
            return REAL["gmm"](*args, **kwargs)

    def attention(*args, **kwargs):
        with carved(int(attn.group(1))):
            return REAL["attn"](*args, **kwargs)

    torch._grouped_mm = gmm if moe else REAL["gmm"]
    object.__setattr__(get_op("swa_attention"), "impl", attention if attn else REAL["attn"])


out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
B1 = ["base", "moe 2", "moe 4", "moe 2 attn 2", "moe 4 attn 4"]
CASES = {1: B1 + [f"{n} again" for n in B1], 32: ["base", "moe 2 attn 2"]}
print_variants(cfg, weights, dev, CASES, variant, width=20, repeats=2, traced=("base", "moe 2 attn 2"), out_dir=out_dir)
variant("base")
