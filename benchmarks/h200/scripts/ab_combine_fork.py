"""Scratch A/B (H200, V4-Flash shapes, B=1 K=1, torch ops, captured replay us): the combine op with
its embedding half on a side lane (as it is), inline (no fork), and the five nodes it replaced;
with the first kernels of one replay of each under torch.profiler (the 7866740 timeline shows the
embedding starting ~9 us after the staging kernel, where cb891d0's started at once). And the
RoPE frequencies and unit modulus made per call again ("rope per call"), as before ops.constants
held them (its first run, ab_combine_fork_5e4d57c.txt). Placements of the fork: "fork first" (5e4d57c's form: the fork
right after the embedding, both norms after it), "hnorm first (as is)" (hnorm on the main stream
before the fork: more kernels ahead of the first fork; ops/combine.py since) and "swapped" (the
hidden half on the lane). In their run (ab_combine_fork_071baa6.txt) the patch went to the
OpDef that ops.triton's registration had already replaced in the registry, so both ran the
lane form: that run is six timings of one form, the noise of a replay time across proposers.

    python benchmarks/h200/scripts/ab_combine_fork.py
"""

import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from ab_combine import five_nodes  # noqa: E402
from scratch_common import profiled_kernels, warm_torch_proposer  # noqa: E402

import graphs.draft_chain as chain  # noqa: E402
import ops.attention  # noqa: E402
import ops.combine  # noqa: E402
from ops.overlap import join_side_stream  # noqa: E402
from ops.registry import get_op  # noqa: E402
from runtime.config import V4Config  # noqa: E402
from runtime.draft_binding import prepare_weights  # noqa: E402
from tools.bench_draft import random_weights, time_replays  # noqa: E402


def rope_per_call(positions, rope_dim, theta, out=None):
    r = rope_dim
    inv_freq = torch.logspace(0.0, -(r - 2) / r, r // 2, base=theta, device=positions.device)
    angle = positions.unsqueeze(1) * inv_freq
    return torch.polar(angle.new_ones(()).expand_as(angle), angle, out=out)


def combine_fork_first(lane_half: str):
    """The combine impl with the fork before both norms, the ``lane_half`` ("e" or "h") on the lane.

    "e" is the form of 5e4d57c; "h" swaps the halves.
    """
    def impl(inputs, outputs, attrs, workspace):
        e, h, e_norm, h_norm, e_proj, h_proj = inputs
        eps = float(attrs["eps"])
        halves = {"e": (e, e_norm, e_proj), "h": (h, h_norm, h_proj)}
        main_half = "h" if lane_half == "e" else "e"
        with REAL["side"]():
            parts = {lane_half: ops.combine.project(*halves[lane_half], eps)}
        parts[main_half] = ops.combine.project(*halves[main_half], eps)
        join_side_stream()
        torch.add(parts["h"], parts["e"].unsqueeze(1) if h.dim() == 3 else parts["e"], out=outputs[0])

    return impl


REAL = {"combiner": chain.combiner, "side": ops.combine.side_stream, "rope": ops.attention.rope_rotation,
        "impl": get_op("combine").impl}
FORMS = {"fork first": combine_fork_first("e"), "swapped": combine_fork_first("h")}


def variant(name):
    chain.combiner = five_nodes if "five" in name else REAL["combiner"]
    ops.combine.side_stream = (lambda: contextlib.nullcontext()) if "inline" in name else REAL["side"]
    ops.attention.rope_rotation = rope_per_call if "rope" in name else REAL["rope"]
    form = next((impl for key, impl in FORMS.items() if key in name), REAL["impl"])
    # The registry's OpDef (register_fused once replaced it on CUDA with a copy); it is frozen.
    object.__setattr__(get_op("combine"), "impl", form)


def first_kernels(replay, n=8) -> list[str]:
    ks = profiled_kernels(replay, Path(tempfile.mkdtemp()) / "trace.json")
    t0 = ks[0]["ts"]
    return [f"    {e['ts'] - t0:7.1f} {e['dur']:5.1f} s{e.get('tid', '?')!s:>4} {e['name'][:70]}" for e in ks[:n]]


dev = torch.device("cuda", 0)
cfg = V4Config.flash().replace(max_position_embeddings=4096)
weights = prepare_weights(cfg, random_weights(cfg, dev), dev)
first = None
NAMES = ["hnorm first (as is)", "fork first", "combine inline", "swapped"]
for name in NAMES + [f"{n} again" for n in NAMES] + [f"{n} third" for n in NAMES[:2]]:
    variant(name)
    prop, ex, d = warm_torch_proposer(cfg, weights, dev, 1)
    first = d if first is None else first
    ms, spread = time_replays(ex.replay)
    print(f"B= 1 {name:22s} replay {ms * 1e3:7.1f} us spread {spread:.3f} same drafts {d == first}", flush=True)
    if "again" not in name and "third" not in name:
        print("\n".join(first_kernels(ex.cuda_graph.replay)), flush=True)
    del prop, ex
    torch.cuda.empty_cache()
variant("combine (lane)")
