"""The bandwidth floor of a draft step (DESIGN.md, "Performance method").

The floor is the bytes a step must read (each touched weight once: e_proj, h_proj,
the mHC fns, the attention weights, the KV window, the gate, the top-k and shared
experts, the LM head rows) divided by the device-to-device copy bandwidth measured
in the same run. The bytes come from the weights' specs, so they are those of the formats the
weights are held in (FP8 + scales, packed MXFP4 + scales, bf16 head): ``python
benchmarks/bench_floor.py`` prints the V4-Flash floor in the checkpoint's formats and in bf16,
and with the draft head quantised to FP8 (``ProposerOptions.head_dtype="fp8"``).
"""

from __future__ import annotations

import torch
from draftgraph.graphs.draft_chain import ChainSpec, build_draft_chain
from draftgraph.graphs.v4_block import CacheGeometry, Numerics, checkpoint_formats
from draftgraph.runtime.ir.graph import Graph
from draftgraph.runtime.ir.schedule import flatten
from draftgraph.runtime.model.config import V4Config

GROUPS = ("e_proj+h_proj", "mhc fns", "attention", "kv window", "gate", "experts", "lm head", "norms+embed")


def floor_graph(cfg: V4Config, fmt: str = "mxfp4", mode: str = "streams", head_dtype: str = "bf16") -> Graph:
    """The K=1 chain with every weight in checkpoint format ``fmt`` (graphs.v4_block.checkpoint_formats).

    ``fmt="mxfp4"`` is the real DeepSeek-V4 layout, the floor that counts (DESIGN.md); "bf16" the
    floor of bf16 weights. ``head_dtype="fp8"``: the head held as FP8 for drafting (the proposer's
    option). Only specs are built: no weight is made, so V4-Flash shapes are free.
    """
    formats = checkpoint_formats(cfg, fmt) if fmt != "bf16" else ()
    if head_dtype == "fp8":
        formats = tuple(sorted((*formats, ("head.weight", "fp8"))))
    numerics = Numerics(formats)
    geometry = CacheGeometry(num_slots=cfg.sliding_window + 16, max_blocks_per_seq=1)
    return build_draft_chain(cfg, geometry, ChainSpec(mode=mode, numerics=numerics))


def step_weight_bytes(cfg: V4Config, distinct_experts: int | None = None, vocab_rows: int | None = None,
                      batch: int = 1, graph: Graph | None = None, fmt: str = "mxfp4") -> dict[str, int]:
    """Bytes one draft step reads, by group, from the weight specs of ``graph`` (the bound chain's, so
    in the formats the weights are held in), or of :func:`floor_graph` in checkpoint format ``fmt``.

    Each weight is read once: whole, except the routed experts (``distinct_experts`` of the stack,
    default top-k: batch 1), the LM head (``vocab_rows`` rows, default all) and the embedding (one
    row per batch row); plus the KV window (bf16 cache rows) of every batch row.
    """
    graph = floor_graph(cfg, fmt) if graph is None else graph
    experts = cfg.num_experts_per_tok if distinct_experts is None else distinct_experts
    rows = vocab_rows or cfg.vocab_size
    totals = dict.fromkeys(GROUPS, 0)
    for value in flatten(graph).weights:
        name, spec = value.name, value.spec
        nbytes = spec.nbytes(batch)
        if ".experts.stacked." in name:
            nbytes = nbytes * experts // cfg.n_routed_experts
        elif name == "head.weight":
            nbytes = nbytes * rows // cfg.vocab_size
        elif name == "embed.weight":
            nbytes = nbytes * batch // cfg.vocab_size
        totals[_group(name)] += nbytes
    totals["kv window"] = batch * cfg.sliding_window * cfg.cache_head_dim * 2  # the bf16 latent cache rows
    return totals


def _group(name: str) -> str:
    if "e_proj" in name or "h_proj" in name:
        return "e_proj+h_proj"
    if "hc_" in name:
        return "mhc fns"
    if "experts" in name:
        return "experts"
    if name == "head.weight":
        return "lm head"
    if ".gate." in name:
        return "gate"
    if ".attn." in name and "norm" not in name:
        return "attention"
    return "norms+embed"


def weight_bytes(graph: Graph) -> int:
    """Device bytes of all the graph's weights (each once, scales included), from their specs."""
    return sum(value.spec.nbytes(1) for value in flatten(graph).weights)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 4 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    times.sort()
    del src, dst
    return nbytes / times[len(times) // 2]


def main() -> int:
    cfg = V4Config.flash()
    for fmt, head_dtype in (("mxfp4", "bf16"), ("mxfp4", "fp8"), ("bf16", "bf16")):
        graph = floor_graph(cfg, fmt, head_dtype=head_dtype)
        groups = step_weight_bytes(cfg, graph=graph)
        print(f"{fmt:>5} head {head_dtype:>4}: MTP weights {weight_bytes(graph) / 1e9:.2f} GB; floor bytes at B=1 "
              f"{sum(groups.values()) / 1e9:.3f} GB = " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in groups.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
