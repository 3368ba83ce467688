"""The bandwidth floor of a draft step (DESIGN.md, "Performance method").

The floor is the bytes a step must read (each touched weight once: e_proj, h_proj,
the mHC fns, the attention weights, the KV window, the gate, the top-k and shared
experts, the LM head rows) divided by the device-to-device copy bandwidth measured
in the same run.
"""

from __future__ import annotations

import torch
from draftgraph.runtime.model.config import V4Config


def step_weight_bytes(cfg: V4Config, distinct_experts: int | None = None, vocab_rows: int | None = None,
                      batch: int = 1, itemsize: int = 2) -> dict[str, int]:
    """Bytes one draft step reads, by group; ``distinct_experts`` defaults to top-k (batch 1)."""
    d, c = cfg.hidden_size, cfg.hc_mult
    h, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g, ol, inter = cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size
    experts = cfg.num_experts_per_tok if distinct_experts is None else distinct_experts
    v = vocab_rows or cfg.vocab_size
    window = min(cfg.sliding_window, 10**9)
    return {
        "e_proj+h_proj": 2 * d * d * itemsize,
        "mhc fns": (2 * cfg.hc_mix_dim * c * d + c * c * d) * 4,
        "attention": (ql * d + h * hd * ql + hd * d + g * ol * (h * hd // g) + d * g * ol) * itemsize,
        "kv window": batch * window * cfg.cache_head_dim * itemsize,
        "gate": cfg.n_routed_experts * d * itemsize,
        "experts": (experts + cfg.n_shared_experts) * 3 * inter * d * itemsize,
        "lm head": v * d * itemsize,
        "norms+embed": (6 * d + cfg.q_lora_rank + hd) * itemsize + batch * d * itemsize,
    }


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
