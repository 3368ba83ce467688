"""Scratch A/B (H200, V4-Flash shapes, K=1, torch ops, captured replay us): the staging kernel and
ops.constants taken away one at a time by a monkeypatch.

- "memcpy staging": the staging copy as a memcpy node (the path without triton), not stage_from_host's kernel.
- "no constants": ops.constants makes its tensors on every call (a kernel each), as before.

Its first run (ab_swap_moe_08009b0.txt) also had a "rows-first MoE" variant at B=8 and 32, against a
swapped-MoE path that was dropped after it.

    python benchmarks/h200/scripts/ab_stage_constants.py
"""

import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from scratch_common import print_variants  # noqa: E402

import ops.constants  # noqa: E402
import runtime.staging  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from tools.bench_draft import random_weights  # noqa: E402

dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
real_rows, real_kept = runtime.staging._triton_rows, ops.constants._kept


def variant(name):
    runtime.staging._triton_rows = (lambda: None) if "memcpy" in name else real_rows
    ops.constants._kept = (lambda key, device, make: make()) if "constants" in name else real_kept
    ops.constants._CONSTANTS.clear()


CASES = {1: ["current", "memcpy staging", "no constants", "memcpy staging + no constants", "current again"],
         32: ["current", "memcpy staging + no constants", "current again"]}
print_variants(cfg, weights, dev, CASES, variant, width=32)
variant("current")
